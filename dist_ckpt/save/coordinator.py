"""One save, from shard write to the rank-0 commit, coordinated through the c10d store.

Call order for a generation ``G`` and attempt ``A`` (``run_save`` drives it on every rank, in
the caller's thread for a synchronous save or in a background thread for an asynchronous
one; the full sequence with store keys is in docs/architecture.md, "Save"):

1. ``write_rank_files`` (all ranks): DCP shard data and this rank's state files below the
   attempt's local directory, hashed (BLAKE3 by default) while written, each file fsynced; then
   ``Attempt.put_files`` hands them to the tier (an object store uploads and verifies them).
2. report (all ranks): a ``RankReport`` under ``report_key(G, A, rank)``: files, sizes,
   digests, DCP write results, or the error.
3. ``commit`` (rank 0, ``dist_ckpt.save.commit``): collect every report until the deadline,
   then publish through the tier, manifest last; on any failure abandon the attempt.
4. outcome (rank 0 posts a ``CommitOutcome`` under ``outcome_key(G, A)``; other ranks wait
   for it with a deadline and release their local bytes). On a tier whose filesystem groups
   hold their own copies, each group's leader then publishes its copy. No collective runs
   in this protocol.

Store keys: reports are deleted by rank 0 once read. Readers of the outcome and of a
node-copy (``published``) key acknowledge it; the rank that set it deletes it once all have
(``StoreKeyRetirer``), so a long run leaves nothing behind.
"""

from __future__ import annotations

import base64
import functools
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from .. import faults
from ..digests import digest_bytes
from ..errors import CommitError
from ..format.manifest import DCP_DIR, GLOBAL_STATE_FILE, OBJECTS_DIR, STATE_DIR, FileEntry, rank_state_file
from ..format.objects import write_copies
from ..protocol import messages
from ..protocol.comm import Comm
from ..protocol.messages import CommitOutcome, RankReport
from ..storage.directio import durable_file
from ..storage.local import fsync_dir, write_durable
from ..tiers.base import remove_own_files
from .commit import commit
from .priority import lower_thread_priority
from .request import SaveJob, SaveRequest
from .reuse import NEW_OBJECT_PREFIX, name_objects, object_file_name, split_plan
from .shardio import SaveAbandoned, hashing_writer, without_zip_crc32

__all__ = ["SaveJob", "SaveRequest", "StoreKeyRetirer", "run_save", "run_save_in_background"]


class StoreKeyRetirer:
    """Deletes the outcome and node-copy keys of finished saves once every reader has read them.

    Readers acknowledge with ``store.add(ack_key(key), 1)`` after reading a key; the rank
    that set the key calls ``retire`` (from the thread that calls ``save()``) for each of its
    finished jobs and deletes a key, and its acknowledgement counter, once the count reaches
    the number of readers. A key whose reader gave up (deadline) is deleted after
    ``max_age`` later saves, when nothing can still be waiting for it.
    """

    def __init__(self, comm: Comm, max_age: int = 64) -> None:
        self.comm = comm
        self.max_age = max_age
        self.waiting: list[tuple[str, int, int]] = []  # key, readers, finished-save index
        self.finished = 0

    def retire(self, job: SaveJob) -> None:
        self.finished += 1
        self.waiting.extend((key, readers, self.finished) for key, readers in job.store_keys)
        keep: list[tuple[str, int, int]] = []
        for key, readers, index in self.waiting:
            try:
                read = self.comm.store.add(messages.ack_key(key), 0)
                if read >= readers or self.finished - index >= self.max_age:
                    self.comm.store.delete_key(key)
                    self.comm.store.delete_key(messages.ack_key(key))
                else:
                    keep.append((key, readers, index))
            except Exception:  # noqa: BLE001 - a leftover key costs bytes, never correctness
                pass
        self.waiting = keep


def write_rank_files(request: SaveRequest, rank: int, io_threads: int,
                     commit_timeout_s: float | None = None) -> tuple[list[dict], bytes]:
    """Write this rank's files; returns the file entries and the pickled DCP write results.
    Past the commit deadline the generation cannot commit: the remaining writes are abandoned
    (``SaveAbandoned``) instead of finished, so a slow disk does not hold the next save."""
    faults.hit("write.before", rank)
    if request.staging_error is not None:
        raise request.staging_error
    local_dir = request.attempt.local_dir
    dcp_dir = os.path.join(local_dir, DCP_DIR)
    state_dir = os.path.join(local_dir, STATE_DIR)
    os.makedirs(dcp_dir, exist_ok=True)
    os.makedirs(state_dir, exist_ok=True)
    cancel = threading.Event()
    timer = None
    if commit_timeout_s is not None:
        timer = threading.Timer(max(0.0, request.started + commit_timeout_s - time.monotonic()), cancel.set)
        timer.daemon = True
        timer.start()
    algorithm = request.digest_algorithm
    plan, object_items, reused_results, object_entries = request.prepared.plan, frozenset(), [], []
    if request.reuse is not None:
        plan, objects, reused_results, object_entries = split_plan(plan, request.reuse)
        object_items = frozenset(objects)
        if object_items:
            os.makedirs(os.path.join(local_dir, OBJECTS_DIR), exist_ok=True)
    writer, filesystem = hashing_writer(dcp_dir, thread_count=io_threads, cancel=cancel, rank=rank,
                                        algorithm=algorithm, direct=request.attempt.direct_io,
                                        object_items=object_items, object_name=object_file_name)
    try:
        with without_zip_crc32():  # the file digest covers every byte already
            results = writer.write_data(plan, request.prepared.planner).wait()
        if cancel.is_set():
            raise SaveAbandoned("the commit deadline passed while writing: not finished")
        if object_items:
            assert request.reuse is not None
            results, written = name_objects(local_dir, results, filesystem.digests, algorithm, rank,
                                            request.reuse, _chunk_of(plan))
            object_entries = _unique(object_entries + written)
            fsync_dir(os.path.join(local_dir, OBJECTS_DIR))
            _second_copies(request, written, cancel)
    except Exception as exc:
        # files this rank began are in no report: nobody else knows to remove them
        # peers may still be writing into the same directories: only this rank's files go
        remove_own_files(local_dir, [{"path": os.path.relpath(p, local_dir)} for p in filesystem.created],
                         remove_dirs=False)
        if filesystem.errors:
            raise filesystem.errors[0] from exc
        raise
    finally:
        if timer is not None:
            timer.cancel()
    entries = [{"path": f"{DCP_DIR}/{name}", "size": size, algorithm: digest, "rank": rank}
               for name, (size, digest) in sorted(filesystem.digests.items())
               if not name.startswith(NEW_OBJECT_PREFIX)] + object_entries
    faults.hit("write.shards_written", rank)  # mid-write: shards on disk, state files not yet
    state_files = [(rank_state_file(rank), request.rank_state)]
    if request.global_state is not None:
        state_files.append((GLOBAL_STATE_FILE, request.global_state))
    for rel, data in state_files:
        write_durable(os.path.join(local_dir, rel), data)
        entries.append({"path": rel, "size": len(data), algorithm: digest_bytes(data, algorithm),
                        "rank": rank})
    fsync_dir(dcp_dir)
    fsync_dir(state_dir)
    faults.hit("write.after", rank)
    return entries, pickle.dumps(results + reused_results)


def _second_copies(request: SaveRequest, written: list[dict], cancel: threading.Event) -> None:
    """The second copy of each new object, where the tier keeps one (a root no mirror backs:
    ``CheckpointConfig.object_copies``, docs/incremental.md): written by the rank that wrote
    the first, so the ranks copy in parallel, within the same deadline."""
    attempt = request.attempt
    # only a tier that keeps shared objects on a filesystem declares it (tiers/rename.py)
    if getattr(attempt, "object_copies", 1) < 2 or not written:
        return
    sink = functools.partial(durable_file, direct=attempt.direct_io)
    if not write_copies(attempt.local_dir, [FileEntry(**e) for e in written], attempt.generation,
                        open_target=sink, stop=cancel.is_set):
        raise SaveAbandoned("the commit deadline passed while writing second copies: not finished")


def _chunk_of(plan: SavePlan) -> Callable[[MetadataIndex], tuple[tuple[int, ...], tuple[int, ...]]]:
    chunks = {item.index: item.tensor_data.chunk for item in plan.items if item.tensor_data is not None}

    def offsets_and_sizes(index: MetadataIndex) -> tuple[tuple[int, ...], tuple[int, ...]]:
        chunk = chunks[index]
        return tuple(chunk.offsets), tuple(chunk.sizes)
    return offsets_and_sizes


def _unique(entries: list[dict]) -> list[dict]:
    """One entry per path: two items with equal bytes are one object."""
    return list({entry["path"]: entry for entry in entries}.values())


def run_save_in_background(job: SaveJob, comm: Comm, io_threads: int, commit_timeout_s: float,
                           nice: int) -> None:
    lower_thread_priority(nice)
    run_save(job, comm, io_threads, commit_timeout_s)


def _write_and_report(request: SaveRequest, comm: Comm, io_threads: int, job: SaveJob,
                      commit_timeout_s: float) -> RankReport:
    outcome_posted = messages.outcome_key(request.generation, request.attempt_id)
    try:
        if comm.rank != 0 and comm.store.check([outcome_posted]):
            raise CommitError("generation already failed before this rank wrote")
        entries, results = write_rank_files(request, comm.rank, io_threads, commit_timeout_s)
        job.written = True  # its bytes are on disk: the space preflight stops counting it
        request.attempt.put_files(entries)
        report = RankReport(comm.rank, entries, base64.b64encode(results).decode("ascii"))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, surfaced as CommitError
        report = RankReport(comm.rank, error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    faults.hit("report.before", comm.rank)
    messages.post(comm, messages.report_key(request.generation, request.attempt_id, comm.rank), report)
    faults.hit("report.after", comm.rank)
    return report


def run_save(job: SaveJob, comm: Comm, io_threads: int, commit_timeout_s: float) -> None:
    """Drive one save on this rank (see the module docstring); never raises, sets job.error."""
    request = job.request
    try:
        report = _write_and_report(request, comm, io_threads, job, commit_timeout_s)
        if comm.rank == 0:
            outcome = commit(request, comm, commit_timeout_s)
            key = messages.outcome_key(request.generation, request.attempt_id)
            messages.post(comm, key, outcome)
            job.store_keys.append((key, comm.world_size - 1))
        else:
            outcome = _await_outcome(request, comm, commit_timeout_s)
            request.attempt.release(report.files, committed=outcome.ok)
        if outcome.ok:
            assert outcome.manifest is not None
            job.manifest_raw = outcome.manifest.encode("utf-8")
            if not comm.root_group_has_rank0 and not request.attempt.shared:
                _publish_node_copy(request, comm, job, commit_timeout_s)
            job.committed = True
        else:
            failures = {int(r): m for r, m in outcome.failures.items()}
            job.error = CommitError(f"generation {request.generation} was not committed",
                                    generation=request.generation, failures=failures)
    except Exception as exc:  # noqa: BLE001 - anything else is this rank's failure
        job.error = CommitError(f"generation {request.generation} failed on rank {comm.rank}",
                                generation=request.generation,
                                failures={comm.rank: f"{type(exc).__name__}: {exc}"})
    finally:
        job.duration_s = time.monotonic() - request.started
        try:
            if job.on_done is not None:
                job.on_done(job)
        except Exception:  # noqa: BLE001 - bookkeeping after the commit must not hang wait()
            traceback.print_exc()
        finally:
            job.done.set()


def _await_outcome(request: SaveRequest, comm: Comm, commit_timeout_s: float) -> CommitOutcome:
    key = messages.outcome_key(request.generation, request.attempt_id)
    # rank 0 stops waiting for reports at the deadline and then needs a moment to publish
    remaining = commit_timeout_s - (time.monotonic() - request.started) + max(30.0, commit_timeout_s)
    if comm.store_wait([key], remaining):
        return CommitOutcome(False, {"0": "rank 0 published no outcome before the deadline"})
    outcome = messages.decode(CommitOutcome, comm.store_get(key))
    comm.store.add(messages.ack_key(key), 1)
    return outcome


def _publish_node_copy(request: SaveRequest, comm: Comm, job: SaveJob,
                       commit_timeout_s: float) -> None:
    """Node-local disks: the leader of a group without rank 0 publishes its node's copy
    (manifest, fsync, rename, root fsync); the group's other ranks wait for it."""
    key = messages.published_key(request.generation, request.attempt_id, comm.fs_leader)
    if comm.rank == comm.fs_leader:
        assert job.manifest_raw is not None
        request.attempt.publish_copy(job.manifest_raw)
        comm.store_set(key, b"1")
        job.store_keys.append((key, len(comm.fs_group) - 1))
    elif comm.store_wait([key], commit_timeout_s):
        raise CommitError(f"rank {comm.fs_leader} did not publish this node's copy of "
                          f"{request.generation}", generation=request.generation)
    else:
        comm.store.add(messages.ack_key(key), 1)
