"""``CheckpointManager.restore``: choose, vet and load the generation a job resumes from.

Call order (all ranks, main thread, on the checkpoint group): ``select_generation`` (every
rank agrees on the generation and the rejections); a signing key that rejects everything
stops here; the leader of each filesystem group moves rejected generations newer than the
chosen one aside; rank 0 checks the latest pointer (broadcast); ``load_generation``; rank 0
logs the outcome; every rank tells the launcher where it resumed from.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .. import events, runinfo
from ..errors import UntrustedGenerations
from ..format.manifest import LATEST_NAME, MANIFEST_NAME, read_latest_name
from . import quarantine
from .loader import RestoreResult, load_generation, select_generation

if TYPE_CHECKING:
    from ..manager import CheckpointManager


def resume(mgr: CheckpointManager, components: Iterable[str] | None,
           allow_contract_change: bool | None, verify_digests: bool) -> RestoreResult:
    tiers = [mgr.tier] + ([mgr.mirror_tier] if mgr.mirror_tier is not None else [])
    name, manifest, tier, rejected = select_generation(mgr.comm, tiers, digests=verify_digests,
                                                          key=mgr.config.signing_key)
    if name is None and rejected and all(p.signature for p in rejected) \
            and mgr.config.key_rejects_all_raises:
        raise UntrustedGenerations(
            f"the signing key rejects every generation under {mgr.config.root} "
            f"({len(rejected)}; first: {rejected[0]}); a fresh start would discard them")
    quarantine.move_blocking(mgr.comm, mgr.tier, rejected, name)
    notes = mgr.comm.broadcast(pointer_warnings(mgr) if mgr.comm.rank == 0 else None)
    if name is None or manifest is None or tier is None:
        runinfo.report(mgr.comm.rank, resumed_from=None, next_update=0,
                       rejected=[str(p) for p in rejected])
        result = RestoreResult(rejected=rejected, warnings=notes)
        if mgr.comm.rank == 0:
            events.log_restore(result, None)
        return result
    allow = mgr.config.allow_contract_change if allow_contract_change is None \
        else allow_contract_change
    result = load_generation(
        mgr.comm, tier, mgr.state, name, manifest,
        mgr.state.components if components is None else components,
        allow_contract_change=allow, strict_torch_version=mgr.config.strict_torch_version,
        scratch_parent=mgr.config.cache_dir)
    result.rejected = rejected
    result.warnings = notes + result.warnings
    if mgr.comm.rank == 0:
        events.log_restore(result, tier.url)
    runinfo.report(mgr.comm.rank, resumed_from=name, next_update=result.next_update,
                   rejected=[str(p) for p in rejected])
    return result


def pointer_warnings(mgr: CheckpointManager) -> list[str]:
    """Rank 0: a latest pointer naming a generation that is not there is worth a warning
    (restore never trusts the pointer, but a person reading the root does)."""
    pointed = read_latest_name(mgr.backend)
    if pointed is None or mgr.backend.exists(f"{pointed}/{MANIFEST_NAME}"):
        return []
    return [f"{LATEST_NAME} points at {pointed}, which is missing under {mgr.config.root}"]
