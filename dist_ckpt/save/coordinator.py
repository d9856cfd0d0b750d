"""One save, from shard write to the rank-0 commit, coordinated through the c10d store.

Call order for a generation ``G`` and attempt ``A`` (``run_save`` drives it on every rank, in
the caller's thread for a synchronous save or in a background thread for an asynchronous
one; the full sequence with store keys is in docs/architecture.md, "Save"):

1. ``write_rank_files`` (all ranks): DCP shard data and this rank's state files below the
   attempt's local directory, hashed (BLAKE3 by default) while written, each file fsynced; then
   ``Attempt.put_files`` hands them to the tier (an object store uploads and verifies them).
2. report (all ranks): a ``RankReport`` (files, sizes, digests, the DCP write results
   unless they repeat the last committed ones, or the error) to rank 0 through the node
   leader (``protocol/gather.py``: each leader posts one key for its node and counts itself
   in).
3. ``commit`` (rank 0, ``dist_ckpt.save.commit``): collect every report until the deadline,
   claim the commit point (``COMMITTING`` under ``outcome_key(G, A)``, compare-and-set),
   then publish through the tier, manifest last; on any failure abandon the attempt.
4. outcome: rank 0 sets a ``CommitOutcome`` (a few hundred bytes: ok, failures, the
   manifest's sha256) under ``outcome_key(G, A)``. Node leaders read it from the store, then
   relay it to their node's ranks through the node directory (``Node.relay_post``); the
   others never read the store for it. The deadline rule: a leader that has seen no outcome
   by save start + ``commit_timeout_s`` + max(30 s, ``commit_timeout_s``) claims the key as
   ``ABANDONED``; rank 0 publishes only after its own claim succeeded, and a leader that finds
   ``COMMITTING`` waits for the verdict. So no rank records as failed a generation rank 0
   commits. Then each rank releases its local bytes; on a tier whose filesystem groups hold
   their own copies, each group's leader publishes its copy with the manifest rank 0 offered
   under ``manifest_key`` (checked against the outcome's digest). No collective runs in
   this protocol.

Store keys: node keys and members' reports are deleted by their one reader. Readers of the
outcome, the offered manifest and a node-copy (``published``) key acknowledge it; the rank
that set it deletes it once all have (``StoreKeyRetirer``), so a long run leaves nothing
behind.
"""

from __future__ import annotations

import functools
import hashlib
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
from ..protocol import gather, messages
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

# past its deadline, rank 0 has this long (or commit_timeout_s, if longer) to claim the commit
# before a node leader may abandon the generation for everyone
OUTCOME_GRACE_S = 30.0
# a rank other than a leader waits for the relay this much past rank 0's own deadline before
# it asks the store (its leader may be dead)
RELAY_GRACE_S = 5.0


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
                      commit_timeout_s: float) -> tuple[RankReport, bytes]:
    """Write this rank's files and post its report; returns the report and its encoded bytes
    (a node leader keeps them for its node message instead of posting)."""
    outcome_posted = messages.outcome_key(request.generation, request.attempt_id)
    digest = ""
    try:
        if comm.rank != 0 and comm.store.check([outcome_posted]):
            raise CommitError("generation already failed before this rank wrote")
        entries, results = write_rank_files(request, comm.rank, io_threads, commit_timeout_s)
        job.written = True  # its bytes are on disk: the space preflight stops counting it
        request.attempt.put_files(entries)
        encoded, digest = request.prepared.results.outgoing(results)
        report = RankReport(comm.rank, entries, encoded, digest)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, surfaced as CommitError
        report = RankReport(comm.rank, error=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    raw = messages.encode(report)
    faults.hit("report.before", comm.rank)
    gather.post(comm, messages.save_scope(request.generation, request.attempt_id), raw)
    faults.hit("report.after", comm.rank)
    return report, raw


def _outcome(request: SaveRequest, comm: Comm, job: SaveJob, raw: bytes,
             commit_timeout_s: float) -> CommitOutcome:
    """This rank's copy of rank 0's verdict (module docstring, steps 3 and 4)."""
    scope = messages.save_scope(request.generation, request.attempt_id)
    key = messages.outcome_key(request.generation, request.attempt_id)
    node = comm.node
    readers: list[int] = []
    if comm.rank == 0:
        outcome, job.manifest_raw, readers = commit(request, comm, commit_timeout_s, raw)
        if job.manifest_raw is not None and len(comm.fs_group) < comm.world_size:
            # leaders of other filesystem groups publish their copy: they need the bytes
            offered = messages.manifest_key(request.generation, request.attempt_id)
            comm.store_set(offered, job.manifest_raw)
            job.store_keys.append((offered, comm.fs_groups - 1))
        encoded = messages.encode(outcome)
        comm.store.set(key, encoded)
        job.store_keys.append((key, comm.world_size - 1))  # every rank acknowledges it
        job.store_keys.append((messages.claim_key(request.generation, request.attempt_id), 0))
    elif node.is_leader:
        faults.hit("node.before_forward", comm.rank)
        readers = list(gather.forward(comm, scope, raw, request.started + commit_timeout_s).received)
        faults.hit("node.after_forward", comm.rank)
        encoded = _await_outcome(request, comm, commit_timeout_s)
    else:
        # rank 0 decides by the deadline plus its grace for the node keys; a leader that died
        # relays nothing, and then this rank asks the store itself, by the leaders' rule
        bound = request.started + commit_timeout_s + gather.GRACE_S + RELAY_GRACE_S - time.monotonic()
        relayed = node.relay_wait(messages.outcome_relay(request.generation, request.attempt_id),
                                  max(0.0, bound))
        if relayed is not None:
            # the key stays in the store until every rank read the outcome: one whose leader
            # closed before it read the relay reads the key instead
            comm.store.add(messages.ack_key(key), 1)
            encoded = relayed
        else:
            encoded = _await_outcome(request, comm, commit_timeout_s)
    if node.is_leader:
        if node.layout.members != (comm.rank,):
            # close waits for the ranks that reported to read it: the others may be dead
            node.relay_post(messages.outcome_relay(request.generation, request.attempt_id), encoded,
                            readers)
        node.hint()  # a replay announcement may follow a commit: the watcher looks sooner
    return messages.decode(CommitOutcome, encoded)


def run_save(job: SaveJob, comm: Comm, io_threads: int, commit_timeout_s: float) -> None:
    """Drive one save on this rank (see the module docstring); never raises, sets job.error."""
    request = job.request
    try:
        report, raw = _write_and_report(request, comm, io_threads, job, commit_timeout_s)
        outcome = _outcome(request, comm, job, raw, commit_timeout_s)
        if comm.rank != 0:
            request.attempt.release(report.files, committed=outcome.ok)
        if outcome.ok:
            request.prepared.results.committed(report.results_sha256)
            job.manifest_sha256 = outcome.manifest_sha256
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


def _hard_bound(request: SaveRequest, comm: Comm) -> float:
    """How long a rank waits for a verdict rank 0 claimed to be publishing: as long as a
    restore may take (the checkpoint group's timeout), from the save's start."""
    return max(0.0, request.started + comm.timeout_s - time.monotonic())


def _await_outcome(request: SaveRequest, comm: Comm, commit_timeout_s: float) -> bytes:
    """A node leader: rank 0's verdict from the store, in one blocking wait (a leader polling
    through the save would load the store once per round per node). At the deadline (rank 0
    stops waiting for reports at ``commit_timeout_s``, then needs a moment to publish) the
    leader claims the commit point as ``ABANDONED``; when rank 0 claimed it first
    (``COMMITTING``: it is publishing), the leader waits for the verdict, up to
    ``_hard_bound``."""
    key = messages.outcome_key(request.generation, request.attempt_id)
    remaining = commit_timeout_s - (time.monotonic() - request.started) \
        + max(OUTCOME_GRACE_S, commit_timeout_s)
    if comm.blocking_wait([key], remaining):
        # the deadline rule: rank 0 claimed the commit by now (it is publishing), or this
        # claim makes the generation failed for every rank
        claim = messages.claim_key(request.generation, request.attempt_id)
        claimed = comm.store.compare_set(claim, "", messages.ABANDONED.decode())
        faults.hit("outcome.abandoned" if claimed == messages.ABANDONED else "outcome.committing",
                   comm.rank)
        if claimed == messages.COMMITTING:
            arrived = not comm.blocking_wait([key], _hard_bound(request, comm))
        else:  # a verdict posted before its claim key was retired still wins
            arrived = comm.store.check([key])
        if not arrived:
            why = "published no outcome before the deadline" if claimed == messages.ABANDONED \
                else "claimed the commit and published no outcome"
            return messages.encode(CommitOutcome(False, {"0": f"rank 0 {why}"}, request.generation))
    value = comm.store_get(key)
    comm.store.add(messages.ack_key(key), 1)
    return value


def _publish_node_copy(request: SaveRequest, comm: Comm, job: SaveJob,
                       commit_timeout_s: float) -> None:
    """Node-local disks: the leader of a group without rank 0 publishes its node's copy
    (manifest, fsync, rename, root fsync); the group's other ranks wait for it. The leader
    reads the manifest rank 0 offered and checks it against the outcome's digest."""
    key = messages.published_key(request.generation, request.attempt_id, comm.fs_leader)
    if comm.rank == comm.fs_leader:
        offered = messages.manifest_key(request.generation, request.attempt_id)
        if comm.blocking_wait([offered], commit_timeout_s):
            raise CommitError(f"rank 0 offered no manifest of {request.generation}",
                              generation=request.generation)
        manifest_raw = comm.store_get(offered)
        comm.store.add(messages.ack_key(offered), 1)
        if hashlib.sha256(manifest_raw).hexdigest() != job.manifest_sha256:
            raise CommitError(f"the manifest of {request.generation} offered by rank 0 does not match "
                              "the outcome's digest", generation=request.generation)
        job.manifest_raw = manifest_raw
        request.attempt.publish_copy(manifest_raw)
        comm.store_set(key, b"1")
        job.store_keys.append((key, len(comm.fs_group) - 1))
    elif comm.store_wait([key], commit_timeout_s):
        raise CommitError(f"rank {comm.fs_leader} did not publish this node's copy of "
                          f"{request.generation}", generation=request.generation)
    else:
        comm.store.add(messages.ack_key(key), 1)
