"""``CheckpointManager.finish``: the last generation of a run, then its DONE record.

Call order (all ranks, main thread): drain saves in flight; rank 0 says whether the final
generation is committed already (a restart after the final save); if not, every rank saves
it; drain again; rank 0 waits for the mirror and builds the record from the committed
manifest, broadcast to all; the writer of each filesystem group (rank 0 alone for an
object-store root) writes ``DONE.json``; an all-gather agrees on failures, which every rank
raises as one ``CommitError``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .. import runinfo
from ..errors import CommitError
from ..format.inventory import inspect_generation
from ..format.manifest import MANIFEST_NAME, Manifest, generation_name, parse_generation
from ..ops.done import DONE_NAME, DoneRecord, record_for, write_done
from ..save.mirror import read_mirror_state
from ..version import __version__

if TYPE_CHECKING:
    from ..manager import CheckpointManager


def finish_run(mgr: CheckpointManager, final_update: int, tokens_seen: int | None) -> DoneRecord:
    comm = mgr.comm
    mgr.wait()
    name = generation_name(final_update)
    committed = comm.broadcast(is_committed(mgr, name) if comm.rank == 0 else None)
    if not committed and mgr.flash is not None:
        _persist_final(mgr, name, final_update, tokens_seen)
    elif not committed:
        mgr.save(final_update, tokens_seen=tokens_seen)
    mgr.wait()
    outcome: tuple[DoneRecord | None, str | None] = (None, None)
    if comm.rank == 0:
        outcome = done_record(mgr, name)
    record, problem = comm.broadcast(outcome)
    if record is None:
        raise CommitError(f"{name} is not final: {problem}", generation=name, failures={0: str(problem)})
    writes_done = comm.rank == (0 if mgr.tier.shared else comm.fs_leader)
    failure = None
    if writes_done:
        try:
            write_done(mgr.backend, record)
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the all-gather
            failure = f"cannot write {DONE_NAME}: {type(exc).__name__}: {exc}"
    failures = {rank: f for rank, f in enumerate(comm.all_gather(failure)) if f is not None}
    if failures:
        raise CommitError(f"{DONE_NAME} for {name} not written", generation=name, failures=failures)
    runinfo.report(comm.rank, done=name)
    return record


def _persist_final(mgr: CheckpointManager, name: str, final_update: int,
                   tokens_seen: int | None) -> None:
    """All ranks, memory tier: the final generation goes to the root whatever
    ``persist_every`` says; when a restart finds it committed in memory already, rank 0
    enqueues that copy instead of saving it again."""
    comm = mgr.comm
    assert mgr.flash is not None and mgr.uploader is not None
    mgr.flash.force(name)
    in_memory = comm.broadcast(mgr.flash.holds(name) if comm.rank == 0 else None)
    if not in_memory:
        mgr.save(final_update, tokens_seen=tokens_seen)
        return
    mgr.uploader.local_committed(name)  # every rank's replay waits for its own copy
    if comm.rank == 0:
        mgr.uploader.enqueue(name, mgr.flash.tier.store.read_bytes(f"{name}/{MANIFEST_NAME}"))


def is_committed(mgr: CheckpointManager, name: str) -> bool:
    if not mgr.backend.exists(f"{name}/{MANIFEST_NAME}"):
        return False
    return inspect_generation(mgr.backend, name, digests=False,
                              key=mgr.config.signing_key).state == "committed"


def done_record(mgr: CheckpointManager, name: str) -> tuple[DoneRecord | None, str | None]:
    """Rank 0: the DONE record of committed generation ``name``, or why there is none."""
    if mgr.uploader is not None:
        if not mgr.uploader.drain(mgr.config.close_timeout_s):
            return None, f"mirror uploads still pending after {mgr.config.close_timeout_s} s"
        completed = read_mirror_state(mgr.write_root).get("last_completed_update")
        if completed is None or completed < (parse_generation(name) or 0):
            return None, "the mirror did not complete it (see mirror.json)"
    try:
        raw = mgr.backend.read_bytes(f"{name}/{MANIFEST_NAME}")
        manifest = Manifest.from_bytes(raw, generation=name)
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        return None, f"{type(exc).__name__}: {exc}"
    return record_for(manifest, raw, run_id=os.environ.get(runinfo.RUN_ID_ENV), version=__version__), None
