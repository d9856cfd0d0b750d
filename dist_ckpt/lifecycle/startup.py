"""A job's start, before its first save: one run, its tiers opened, the pins shared, the
state restored.

Call order (``CheckpointManager.__init__``, every rank, after the checkpoint ``Comm``):
``check_run_id`` (collective: one all-gather) -> ``open_tiers`` (local: the root, the memory
tier, the mirror) -> the ``Context`` -> ``share_pins`` (rank 0 writes the store key; the
other ranks read it when they prune). Then ``CheckpointManager.restore`` -> ``restore`` (all
ranks, collective).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .. import logs, runinfo
from ..config import CheckpointConfig
from ..context import Context, Tiers
from ..errors import ConfigError
from ..memory.runner import MemoryTierRunner
from ..protocol.comm import Comm
from ..protocol.messages import PINS_KEY
from ..restore.loader import RestoreResult
from ..restore.resume import resume
from ..save.reuse import ReuseLedger, seed_after_restore
from ..tiers import CommitTier, TierOptions, open_tier
from . import retention

log = logs.get("dist_ckpt.manager")


def check_run_id(comm: Comm) -> None:
    """All ranks: refuse a job whose launchers disagree on the run (they would mix two runs'
    shards under one root)."""
    run_ids = comm.all_gather(os.environ.get(runinfo.RUN_ID_ENV))
    if len(set(run_ids)) > 1:
        error = ConfigError(f"ranks disagree on the launcher run id ({runinfo.RUN_ID_ENV}): "
                            f"{dict(enumerate(run_ids))}; start every node with the same run")
        runinfo.report_failure(error, comm.rank)
        raise error


@dataclass(frozen=True)
class OpenedTiers:
    tiers: Tiers
    memory: MemoryTierRunner | None  # with memory_tier=True: saves commit to this node's memory
    scratch: str | None  # an object-store root's local scratch, this job's own: removed at close


def open_tiers(config: CheckpointConfig, comm: Comm) -> OpenedTiers:
    """This rank's tiers (no collective)."""
    scratch = None if config.cache_dir else os.path.join(
        tempfile.gettempdir(), f"dist_ckpt-scratch-{comm.session}")
    root = open_tier(config.root, TierOptions(
        storage_options=dict(config.storage_options or {}),
        scratch_root=config.cache_dir or scratch,
        upload_verification=config.upload_verification, direct_io=config.direct_io,
        # a mirror holds every shared object once more, off this disk: no second copy then
        object_copies=config.object_copies if config.mirror is None else 1))
    memory = MemoryTierRunner(config, root) if config.memory_tier else None
    tiers = Tiers(root=root, target=memory.tier if memory is not None else root,
                  mirror=_open_mirror(config))
    return OpenedTiers(tiers, memory, scratch)


def _open_mirror(config: CheckpointConfig) -> CommitTier | None:
    if config.mirror is None:
        return None
    return open_tier(config.mirror, TierOptions(
        storage_options=dict(config.storage_options or {}),
        concurrency=config.mirror_concurrency, upload_verification=config.upload_verification,
        direct_io=config.direct_io))


def share_pins(ctx: Context) -> None:
    """Rank 0: the root's pins into the store, for the leaders of other nodes (``pins.json``
    may be on rank 0's node only). A corrupt ``pins.json`` stops pruning, not training."""
    if not ctx.is_root_rank:
        return
    try:
        ctx.comm.publish_names(PINS_KEY, retention.read_pins(ctx.tiers.root.store))
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("cannot read the pins under %s", ctx.config.root)


def remove_scratch(scratch: str | None) -> None:
    """At close, when no save of this rank still runs: the job's own scratch directory."""
    if scratch is not None:
        with contextlib.suppress(OSError):  # absent, or still holding a save's files
            os.rmdir(scratch)


def restore(ctx: Context, memory: MemoryTierRunner | None, reuse: ReuseLedger | None,
            components: Iterable[str] | None, allow_contract_change: bool | None, verify_digests: bool,
            on_all_rejected: Literal["raise", "fresh"] | None) -> RestoreResult:
    """All ranks: the newest generation that validates, loaded (``restore/resume.py``); the
    memory tier told before and after; the incremental ledger seeded from what was loaded."""
    if memory is not None:
        memory.before_restore()
    result = resume(ctx, components, allow_contract_change, verify_digests, on_all_rejected)
    if memory is not None:
        memory.after_restore(ctx.comm, result)
    seed_after_restore(reuse, ctx.state, result, ctx.tiers.target)
    return result
