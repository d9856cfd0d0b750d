"""One save, from shard write to the rank-0 commit, coordinated through the c10d store.

Call order for a generation ``G`` (``run_save`` drives it on every rank, in the caller's
thread for a synchronous save or in a background thread for an asynchronous one):

1. ``write_rank_files`` (all ranks): DCP shard data and this rank's state files into the
   private pending directory, hashed (sha256) while it is written, each file fsynced.
2. report (all ranks): ``G/report/<rank>`` in the store: files, sizes, digests, DCP write
   results, or the error.
3. ``commit`` (rank 0): wait for every report until the deadline; write DCP ``.metadata``,
   then ``manifest.json`` last, fsync, rename the pending directory to its final name,
   fsync the root, validate, then replace ``latest.json``. On any failure: remove the
   pending directory, publish nothing.
4. outcome (rank 0 publishes ``G/outcome``; other ranks wait for it with a deadline and, on
   failure, remove what they wrote). No collective runs in this protocol.

Store keys: reports are deleted by rank 0 once read. Readers of the outcome and of a
node-copy (``published``, set by a group leader) key acknowledge it; the rank that set it
deletes it once all have (``StoreKeyRetirer``), so a long run leaves nothing behind.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import faults
from ..errors import CommitError, GenerationExists
from ..format.manifest import DCP_DIR, GLOBAL_STATE_FILE, STATE_DIR, rank_state_file
from ..protocol.comm import Comm
from ..storage.local import fsync_dir, write_durable
from ..storage.objectstore import ObjectStoreBackend
from ..tiers.objectstore import upload_files
from ..tiers.rename import PublishInfo, publish_generation, publish_node_copy
from .planning import PreparedSave
from .shardio import hashing_writer


@dataclass
class SaveRequest:
    generation: str
    next_update: int
    tokens_seen: int
    root: str
    pending_name: str
    prepared: PreparedSave
    rank_state: bytes
    global_state: bytes | None  # rank 0 only
    info: PublishInfo | None  # rank 0 only
    remote: ObjectStoreBackend | None = None  # set when the root is an object store
    local_ranks: frozenset[int] | None = None  # ranks whose files this node's disk holds
    signing_key: bytes | None = field(default=None, repr=False)  # HMAC key for manifest.sig
    started: float = field(default_factory=time.monotonic)

    @property
    def data_dir(self) -> str:
        """Object-store attempt directory inside the generation ("" on a filesystem)."""
        return f"attempt-{self.pending_name.rsplit('-', 1)[-1]}" if self.remote is not None else ""

    @property
    def pending(self) -> str:
        return os.path.join(self.root, self.pending_name)


@dataclass
class SaveJob:
    request: SaveRequest
    on_done: Callable[[SaveJob], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: CommitError | None = None
    thread: threading.Thread | None = None
    committed: bool = False
    duration_s: float = 0.0
    manifest_raw: bytes | None = None
    blocking_s: float = 0.0  # training time this save took on the calling thread
    store_keys: list[tuple[str, int]] = field(default_factory=list)  # (key set here, readers)
    written: bool = False


class StoreKeyRetirer:
    """Deletes the outcome and node-copy keys of finished saves once every reader has read them.

    Readers acknowledge with ``store.add(<key>/read, 1)`` after reading a key; the rank that
    set the key calls ``retire`` (from the thread that calls ``save()``) for each of its
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
                read = self.comm.store.add(_ack_key(key), 0)
                if read >= readers or self.finished - index >= self.max_age:
                    self.comm.store.delete_key(key)
                    self.comm.store.delete_key(_ack_key(key))
                else:
                    keep.append((key, readers, index))
            except Exception:  # noqa: BLE001 - a leftover key costs bytes, never correctness
                pass
        self.waiting = keep


def _ack_key(key: str) -> str:
    return f"{key}/read"


def _report_key(generation: str, nonce: str, rank: int) -> str:
    return f"{generation}/{nonce}/report/{rank}"


def _outcome_key(generation: str, nonce: str) -> str:
    return f"{generation}/{nonce}/outcome"


def write_rank_files(request: SaveRequest, rank: int, io_threads: int) -> tuple[list[dict], bytes]:
    """Write this rank's files; returns the file entries and the pickled DCP write results."""
    faults.hit("write.before", rank)
    dcp_dir = os.path.join(request.pending, DCP_DIR)
    state_dir = os.path.join(request.pending, STATE_DIR)
    os.makedirs(dcp_dir, exist_ok=True)
    os.makedirs(state_dir, exist_ok=True)
    writer, filesystem = hashing_writer(dcp_dir, thread_count=io_threads)
    try:
        results = writer.write_data(request.prepared.plan, request.prepared.planner).wait()
    except Exception as exc:
        if filesystem.errors:
            raise filesystem.errors[0] from exc
        raise
    entries = [{"path": f"{DCP_DIR}/{name}", "size": size, "sha256": digest, "rank": rank}
               for name, (size, digest) in sorted(filesystem.digests.items())]
    state_files = [(rank_state_file(rank), request.rank_state)]
    if request.global_state is not None:
        state_files.append((GLOBAL_STATE_FILE, request.global_state))
    for rel, data in state_files:
        write_durable(os.path.join(request.pending, rel), data)
        entries.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                        "rank": rank})
    fsync_dir(dcp_dir)
    fsync_dir(state_dir)
    faults.hit("write.after", rank)
    return entries, pickle.dumps(results)


def lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value by ``nice`` (Linux: per thread, inherited by threads it
    starts), so background checkpoint work yields the CPU to the training loop."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    thread_id = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + nice))
    except OSError:
        pass


def run_save_in_background(job: SaveJob, comm: Comm, io_threads: int, commit_timeout_s: float,
                           nice: int) -> None:
    lower_thread_priority(nice)
    run_save(job, comm, io_threads, commit_timeout_s)


def run_save(job: SaveJob, comm: Comm, io_threads: int, commit_timeout_s: float) -> None:
    """Drive one save on this rank (see the module docstring); never raises, sets job.error."""
    request = job.request
    nonce = request.pending_name
    try:
        report: dict = {"rank": comm.rank}
        try:
            if comm.rank != 0 and comm.store.check([_outcome_key(request.generation, nonce)]):
                raise CommitError("generation already failed before this rank wrote")
            entries, results = write_rank_files(request, comm.rank, io_threads)
            job.written = True  # its bytes are on disk: the space preflight stops counting it
            if request.remote is not None:
                upload_files(request.remote, request.pending, request.generation, request.data_dir,
                             entries)
            report.update(files=entries, results=base64.b64encode(results).decode("ascii"))
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, surfaced as CommitError
            report["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        faults.hit("report.before", comm.rank)
        comm.store_set(_report_key(request.generation, nonce, comm.rank),
                       json.dumps(report).encode())
        if comm.rank == 0:
            outcome = commit(request, comm, commit_timeout_s)
            comm.store_set(_outcome_key(request.generation, nonce), json.dumps(outcome).encode())
            job.store_keys.append((_outcome_key(request.generation, nonce), comm.world_size - 1))
        else:
            outcome = _await_outcome(request, comm, commit_timeout_s)
            if not outcome["ok"] or request.remote is not None:
                _remove_own_files(request, report.get("files", []))
        if outcome["ok"]:
            job.manifest_raw = outcome["manifest"].encode("utf-8")
            if request.remote is None and not comm.root_group_has_rank0:
                _publish_node_copy(request, comm, job.manifest_raw, commit_timeout_s)
                if comm.rank == comm.fs_leader:
                    job.store_keys.append((_published_key(request, comm.fs_leader),
                                           len(comm.fs_group) - 1))
            job.committed = True
        else:
            failures = {int(r): m for r, m in outcome["failures"].items()}
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


def _await_outcome(request: SaveRequest, comm: Comm, commit_timeout_s: float) -> dict:
    key = _outcome_key(request.generation, request.pending_name)
    # rank 0 stops waiting for reports at the deadline and then needs a moment to publish
    remaining = commit_timeout_s - (time.monotonic() - request.started) + max(30.0, commit_timeout_s)
    if comm.store_wait([key], remaining):
        return {"ok": False, "failures": {"0": "rank 0 published no outcome before the deadline"}}
    outcome = json.loads(comm.store_get(key))
    comm.store.add(_ack_key(key), 1)
    return outcome


def _published_key(request: SaveRequest, leader: int) -> str:
    return f"{request.generation}/{request.pending_name}/published/{leader}"


def _publish_node_copy(request: SaveRequest, comm: Comm, manifest_raw: bytes,
                       commit_timeout_s: float) -> None:
    """Node-local disks: the leader of a group without rank 0 publishes its node's copy
    (manifest, fsync, rename, root fsync); the group's other ranks wait for it."""
    key = _published_key(request, comm.fs_leader)
    if comm.rank == comm.fs_leader:
        publish_node_copy(request, manifest_raw)
        comm.store_set(key, b"1")
    elif comm.store_wait([key], commit_timeout_s):
        raise CommitError(f"rank {comm.fs_leader} did not publish this node's copy of "
                          f"{request.generation}", generation=request.generation)
    else:
        comm.store.add(_ack_key(key), 1)


def _remove_own_files(request: SaveRequest, entries: list[dict]) -> None:
    for entry in entries:
        try:
            os.unlink(os.path.join(request.pending, entry["path"]))
        except FileNotFoundError:
            pass
    for directory in (DCP_DIR, STATE_DIR, ""):
        try:
            os.rmdir(os.path.join(request.pending, directory))
        except OSError:
            pass


def collect_reports(request: SaveRequest, comm: Comm,
                    commit_timeout_s: float) -> tuple[list[dict], dict[int, str]]:
    """Rank 0: every rank's report, or the failures (late, missing, or failed ranks)."""
    keys = [_report_key(request.generation, request.pending_name, r) for r in range(comm.world_size)]
    remaining = commit_timeout_s - (time.monotonic() - request.started)
    missing = set(comm.store_wait(keys, remaining)) if remaining > 0 else {
        k for k in keys if not comm.store.check([k])}
    failures: dict[int, str] = {}
    reports: list[dict] = []
    for rank, key in enumerate(keys):
        if key in missing:
            failures[rank] = f"did not report within commit_timeout_s={commit_timeout_s:g}"
            continue
        report = json.loads(comm.store_get(key))
        if "error" in report:
            failures[rank] = report["error"]
        reports.append(report)
    if not failures and time.monotonic() - request.started > commit_timeout_s:
        failures[0] = f"rank 0 did not finish within commit_timeout_s={commit_timeout_s:g}"
    for key in keys:
        if key not in missing:
            comm.store.delete_key(key)
    return reports, failures


def commit(request: SaveRequest, comm: Comm, commit_timeout_s: float) -> dict:
    """Rank 0: publish the generation if every rank reported in time; returns the outcome."""
    reports, failures = collect_reports(request, comm, commit_timeout_s)
    if not failures:
        try:
            results = [pickle.loads(base64.b64decode(r["results"])) for r in reports]
            entries = [entry for r in reports for entry in r["files"]]
            assert request.info is not None and request.prepared.metadata is not None
            manifest = publish_generation(request, request.info, entries, results)
        except GenerationExists as exc:
            failures[0] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any publish failure fails the generation
            traceback.print_exc()
            failures[0] = f"{type(exc).__name__}: {exc}"
    if request.remote is not None:
        shutil.rmtree(request.pending, ignore_errors=True)  # local scratch of an upload
    if failures:
        shutil.rmtree(request.pending, ignore_errors=True)
        if request.remote is not None:
            _forget_attempt(request)
        return {"ok": False, "failures": {str(r): m for r, m in failures.items()}}
    return {"ok": True, "failures": {}, "manifest": manifest.to_bytes().decode("utf-8")}


def _forget_attempt(request: SaveRequest) -> None:
    # best effort: the pruner removes whatever a crashed uploader leaves behind
    try:
        assert request.remote is not None
        request.remote.remove_tree(f"{request.generation}/{request.data_dir}")
    except Exception:  # noqa: BLE001 - cleanup must not mask the commit failure
        traceback.print_exc()
