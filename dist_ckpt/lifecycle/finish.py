"""``CheckpointManager.finish``: the last generation of a run, then its DONE record.

Call order (all ranks, main thread; the manager drains its saves before each step):
1. ``final_step`` (collective): whether the final generation is committed already on the root
   (a restart after the final save) and, with the memory tier, whether memory holds it
   committed (``holds_committed``: rank 0 checks a tier with one copy; on a tier with one copy
   per node, each copy's leader checks its part and an all-gather agrees); every rank gets the
   same :class:`FinalStep` back. The manager then
   does what it says: nothing, ``save(final_update)``, or ``persist_from_memory``.
2. ``write_done`` (collective, after the manager drained again): rank 0 waits for the replays
   in chain order (persistence to the root, then the mirror) and checks that each completed
   the final generation, so DONE is written only once that generation is in every configured
   tier; it builds the record from the committed manifest, broadcast to all; the leader of
   each copy of the root (rank 0 alone for a shared or object-store root) writes
   ``DONE.json``; an all-gather agrees on failures, which every rank raises as one
   ``CommitError``.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable

from .. import runinfo
from ..context import Context
from ..errors import CommitError, DistCkptError
from ..format.inventory import is_committed
from ..format.manifest import MANIFEST_NAME, Manifest, parse_generation
from ..format.validate import check_sizes, check_structure
from ..memory.runner import MemoryTierRunner
from ..replay.channels import channel
from ..replay.record import read_record
from ..tiers.base import CommitTier
from ..version import __version__
from .done import DONE_NAME, DoneRecord, record_for
from .done import write_done as write_done_record
from .replication import ReplayChain


class FinalStep(enum.Enum):
    COMMITTED = "committed"  # nothing to save: a restart found the final generation committed
    SAVE = "save"  # every rank saves the final generation
    PERSIST_FROM_MEMORY = "persist from memory"  # committed in memory: only the root's copy is missing


def final_step(ctx: Context, name: str, memory: MemoryTierRunner | None) -> FinalStep:
    """All ranks. With the memory tier, the final generation goes to the root whatever
    ``persist_every`` says."""
    if holds_committed(ctx, ctx.tiers.root, name, ctx.root_groups.leader):
        return FinalStep.COMMITTED
    if memory is None:
        return FinalStep.SAVE
    memory.force(name)
    in_memory = holds_committed(ctx, memory.tier, name, ctx.comm.fs_leader)
    return FinalStep.PERSIST_FROM_MEMORY if in_memory else FinalStep.SAVE


def holds_committed(ctx: Context, tier: CommitTier, name: str, leader: int) -> bool:
    """All ranks (collective): whether ``tier`` holds ``name`` committed. A tier with one copy
    per node (node-local disks, the memory tier on several nodes) holds it whole on no node:
    there the leader of each copy (``leader``: this rank's) checks that its copy holds the
    manifest and the files of the ranks it serves (``tier.local_ranks``), rank 0 also the
    signature, and every copy must hold the same manifest."""
    comm, key = ctx.comm, ctx.config.signing_key
    if tier.shared:
        return comm.broadcast(is_committed(tier.store, name, key) if comm.rank == 0 else None)
    part = (True, _part_digest(tier, name, key if comm.rank == 0 else None)) if comm.rank == leader \
        else (False, None)
    digests = [digest for is_leader, digest in comm.all_gather(part) if is_leader]
    return None not in digests and len(set(digests)) == 1


def _part_digest(tier: CommitTier, name: str, key: bytes | None) -> str | None:
    """The sha256 of this copy's manifest of ``name`` when its structure and the sizes of its
    ranks' files check out; else None."""
    store, ranks = tier.store, tier.local_ranks
    try:
        raw = store.read_bytes(f"{name}/{MANIFEST_NAME}")
        manifest = check_structure(store, name, key=key)
        check_sizes(store, name, manifest.model_copy(
            update={"files": [f for f in manifest.files if ranks is None or f.rank in ranks]}))
    except (DistCkptError, OSError):
        return None
    return hashlib.sha256(raw).hexdigest()


def persist_from_memory(ctx: Context, memory: MemoryTierRunner, name: str) -> None:
    """All ranks: the copy committed in memory goes to the root (rank 0 enqueues it; every
    rank's replay waits for its own files)."""
    assert memory.persister is not None
    memory.persister.local_committed(name)
    if ctx.comm.rank == 0:
        memory.persister.enqueue(name, memory.tier.store.read_bytes(f"{name}/{MANIFEST_NAME}"))


def write_done(ctx: Context, name: str, replayer: ReplayChain | None) -> DoneRecord:
    """All ranks, once no save is in flight: DONE for committed generation ``name``."""
    comm = ctx.comm
    outcome: tuple[DoneRecord | None, str | None] = (None, None)
    if comm.rank == 0:
        outcome = done_record(ctx, name, replayer)
    record, problem = comm.broadcast(outcome)
    if record is None:
        raise CommitError(f"{name} is not final: {problem}", generation=name, failures={0: str(problem)})
    failure = None
    if comm.rank == ctx.root_groups.leader:
        try:
            write_done_record(ctx.tiers.root.store, record)
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the all-gather
            failure = f"cannot write {DONE_NAME}: {type(exc).__name__}: {exc}"
    failures = {rank: f for rank, f in enumerate(comm.all_gather(failure)) if f is not None}
    if failures:
        raise CommitError(f"{DONE_NAME} for {name} not written", generation=name, failures=failures)
    runinfo.report(comm.rank, done=name)
    return record


def done_record(ctx: Context, name: str,
                replayer: ReplayChain | None) -> tuple[DoneRecord | None, str | None]:
    """Rank 0: the DONE record of committed generation ``name``, or why there is none."""
    timeout_s = ctx.config.close_timeout_s
    if replayer is not None:
        if not replayer.drain(timeout_s):
            channels = ", ".join(stage.channel for stage in replayer.stages)
            return None, f"replays ({channels}) still pending after {timeout_s} s"
        for stage in replayer.stages:  # memory -> root -> mirror: each one completed it
            completed = read_record(stage.source.store, stage.channel).get("last_completed_update")
            if completed is None or completed < (parse_generation(name) or 0):
                return None, (f"the {stage.channel} replay did not complete it (see "
                              f"{channel(stage.channel).record} under {stage.source.local_root})")
    try:
        raw = ctx.tiers.root.store.read_bytes(f"{name}/{MANIFEST_NAME}")
        manifest = Manifest.from_bytes(raw, generation=name)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        return None, f"{type(exc).__name__}: {exc}"
    return record_for(manifest, raw, run_id=os.environ.get(runinfo.RUN_ID_ENV), version=__version__), None


def end_run(ctx: Context, name: str, memory: MemoryTierRunner | None, replayer: ReplayChain | None,
            save: Callable[[], object], wait: Callable[[], None]) -> DoneRecord:
    """Steps 1 and 2 for the final generation ``name`` (all ranks): ``save`` saves it,
    ``wait`` drains this rank's saves."""
    wait()
    step = final_step(ctx, name, memory)
    if replayer is not None:
        replayer.force(name)  # the mirror too, whatever mirror_every says
    if step is FinalStep.SAVE:
        save()
    elif step is FinalStep.PERSIST_FROM_MEMORY:
        assert memory is not None
        persist_from_memory(ctx, memory, name)
    wait()
    return write_done(ctx, name, replayer)
