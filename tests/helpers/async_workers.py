"""Asynchronous-save scenarios run inside spawned ranks."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

from dist_ckpt import CommitError, faults
from dist_ckpt.save.staging import local_tensors
from tests.helpers import workers

DEADLINE_S = 3.0  # waited out by the late-rank cases; healthy saves must commit within it beside other tests


def _latest(root: str) -> bytes:
    with open(os.path.join(root, "latest.json"), "rb") as handle:
        return handle.read()


def _save_in_flight(mgr, update: int):
    """save(); returns the job and whether it was still in flight when save() returned. The
    scenarios hold a peer's writer (a blocked fault point) until after this returns, so a
    save() that waited for the commit could not return with its job in flight."""
    job = mgr.save(update)
    return job, job is not None and not job.done.is_set()


def _parked_in_save(thread_id: int) -> bool:
    """Whether thread ``thread_id`` waits on an event or condition for the oldest save in
    flight (``InFlight.wait_oldest``, the in-flight wait of the ``block`` policy)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None or not frame.f_code.co_filename.endswith("threading.py"):
        return False
    while frame is not None and frame.f_code.co_filename.endswith("threading.py"):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "wait_oldest" \
        and frame.f_code.co_filename.endswith("inflight.py")


def _release_when_parked(name: str, thread_id: int, returned: threading.Event,
                         out: dict) -> threading.Thread:
    """Release block ``name`` once ``thread_id`` is parked in save()'s in-flight wait (or once
    save() returned without parking: ``out["parked"]`` stays False)."""

    def run() -> None:
        deadline = time.monotonic() + 120.0
        while not returned.is_set() and time.monotonic() < deadline:
            if _parked_in_save(thread_id):
                out["parked"] = True
                break
            returned.wait(0.01)
        faults.release(name)

    out["parked"] = False
    thread = threading.Thread(target=run, name=f"release-{name}", daemon=True)
    thread.start()
    return thread


def _expect_failure(mgr) -> tuple[str | None, dict[int, str], float]:
    started = time.perf_counter()
    try:
        mgr.wait()
    except CommitError as exc:
        return exc.generation, exc.failures, time.perf_counter() - started
    raise AssertionError("expected a CommitError")


def slow_and_failing_ranks(rank: int, world: int, root: str, fault_dir: str) -> dict:
    """Rank 1's writer (or report) is held at a blocked fault point that rank 0 releases only
    after its own save() returned (and, for a late rank, after the deadline failed the
    generation): ordering by events, never by a delay being long enough."""
    job = workers.build("fsdp", rank, world)
    mgr = workers.manager(job, root, async_save=True, max_in_flight=1, commit_timeout_s=DEADLINE_S)
    out: dict = {}
    workers.train_step(job)
    mgr.save(1)
    mgr.wait()

    def held(point: str, name: str, **more) -> None:
        faults.configure({point: {"rank": 1, "block": name, "block_timeout_s": 90, **more}},
                         fault_dir=fault_dir)

    held("write.before", "below")  # slow, released before the deadline
    workers.train_step(job)
    _, out["below_in_flight"] = _save_in_flight(mgr, 2)
    if rank == 0:
        faults.wait_reached("below", rank=1, fault_dir=fault_dir)
        faults.release("below", fault_dir=fault_dir)
    mgr.wait()
    latest_before = _latest(root) if rank == 0 else b""

    held("write.before", "above")  # released only once the deadline failed the generation
    workers.train_step(job)
    started = time.perf_counter()
    _, out["above_in_flight"] = _save_in_flight(mgr, 3)
    if rank == 0:
        faults.wait_reached("above", rank=1, fault_dir=fault_dir)
    out["above"] = _expect_failure(mgr)
    out["above_since_save_s"] = time.perf_counter() - started
    if rank == 0:
        out["latest_unchanged"] = _latest(root) == latest_before
        out["entries_after_above"] = sorted(os.listdir(root))
        faults.release("above", fault_dir=fault_dir)

    faults.configure(None)
    workers.train_step(job)
    mgr.save(4)
    mgr.wait()

    held("write.before", "crash", **{"raise": True})  # crashed writer (after rank 0's save returned)
    workers.train_step(job)
    _, out["crash_in_flight"] = _save_in_flight(mgr, 5)
    if rank == 0:
        faults.wait_reached("crash", rank=1, fault_dir=fault_dir)
        faults.release("crash", fault_dir=fault_dir)
    out["crash"] = _expect_failure(mgr)

    held("report.before", "missing")  # the report is held until the deadline failed it
    workers.train_step(job)
    saved, out["missing_in_flight"] = _save_in_flight(mgr, 6)
    releaser = None
    if rank == 0:
        faults.wait_reached("missing", rank=1, fault_dir=fault_dir)

        def release_after_deadline() -> None:  # rank 0's main thread waits inside save(7)
            saved.done.wait()
            faults.release("missing", fault_dir=fault_dir)

        releaser = threading.Thread(target=release_after_deadline, daemon=True)
        releaser.start()
    workers.train_step(job)
    try:  # the failure surfaces at the next save() on every rank, which does not save
        mgr.save(7)
        out["next_save_raised"] = None
    except CommitError as exc:
        out["next_save_raised"] = (exc.generation, exc.failures)
    if releaser is not None:
        releaser.join()
    faults.configure(None)
    mgr.save(8)
    mgr.wait()
    out["planning_rounds"] = mgr.plans.planning_rounds
    out["committed"] = [g.name for g in mgr.generations() if g.state == "committed"]
    out["pending"] = [g.name for g in mgr.generations() if g.state == "pending"]
    mgr.close()
    return out


def _local_state_bytes(job: workers.Job) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(job.state.tensor_state()))


def in_flight_bound(rank: int, world: int, root: str) -> dict:
    """Every rank's writers are held at ``write.before`` (a blocked point of this process):
    the first save is in flight for as long as the scenario needs. With ``block`` the second
    save() must park in the in-flight wait; the writer is released only once it has."""
    out: dict = {}
    for policy, slots in (("block", 1), ("skip", 1), ("block", 2)):
        name = f"{policy}{slots}"
        faults.configure({"write.before": {"block": name}})
        job = workers.build("fsdp", rank, world)
        sub = os.path.join(root, name)
        mgr = workers.manager(job, sub, async_save=True, max_in_flight=slots, in_flight_policy=policy)
        workers.train_step(job)
        first, first_in_flight = _save_in_flight(mgr, 1)
        faults.wait_reached(name)  # the first save's writer is held: it cannot finish
        workers.train_step(job)
        result: dict = {"first_in_flight": first_in_flight}
        returned = threading.Event()
        releaser = None
        if policy == "block" and slots == 1:
            releaser = _release_when_parked(name, threading.get_ident(), returned, result)
        second = mgr.save(2)
        returned.set()
        result.update(first_done_at_second=first.done.is_set(), second_skipped=second is None,
                      skipped=mgr.stats.skipped, peak=mgr.staging.peak_bytes,
                      allocations=mgr.staging.allocations, state_bytes=_local_state_bytes(job))
        if releaser is not None:
            releaser.join()
        faults.release(name)
        out[(policy, slots)] = result
        mgr.wait()
        out[(policy, slots)]["committed"] = sorted(
            g.name for g in mgr.generations() if g.state == "committed")
        mgr.close()
        faults.configure(None)
    return out


def store_keys_after_saves(rank: int, world: int, root: str) -> dict:
    """Four async saves; which per-save store keys are still present afterwards."""
    from dist_ckpt.protocol.messages import ack_key, outcome_key

    job = workers.build("ddp", rank, world)
    mgr = workers.manager(job, root, async_save=True, max_in_flight=1)
    keys = []
    for update in range(1, 5):
        workers.train_step(job)
        saved = mgr.save(update)
        keys.append(outcome_key(saved.request.generation, saved.request.attempt_id))
        mgr.wait()
    mgr.comm.barrier()  # every rank's last acknowledgement is in the store
    present = [mgr.comm.store.check([key]) for key in keys]
    acks = [mgr.comm.store.check([ack_key(key)]) for key in keys]
    mgr.close()
    return {"present": present, "acks": acks}


def _gloo_worker_threads() -> int:
    """Native gloo worker threads of this process (two per live gloo group)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as handle:
                count += handle.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def close_leaves_no_threads(rank: int, world: int, root: str) -> dict:
    """Threads and buffers left by close(): after async saves with retention, after a save
    that outlives the close timeout, and after a job destroyed the default group first."""
    job = workers.build("fsdp", rank, world)
    workers.train_step(job)
    before = {"python": sorted(t.name for t in threading.enumerate()), "gloo": _gloo_worker_threads()}
    out: dict = {"before": before}
    mgr = workers.manager(job, os.path.join(root, "plain"), async_save=True, max_in_flight=2,
                          keep_last=2)
    out["during_gloo"] = _gloo_worker_threads()
    for update in (1, 2, 3):
        workers.train_step(job)
        mgr.save(update)
    mgr.close()
    out["plain"] = {"python": sorted(t.name for t in threading.enumerate()),
                    "gloo": _gloo_worker_threads(), "staging": mgr.staging.allocated_bytes,
                    "jobs": len(mgr.inflight.jobs), "group_released": mgr.comm.group is None}

    mgr = workers.manager(job, os.path.join(root, "late"), async_save=True, close_timeout_s=0.2)
    faults.configure({"write.before": {"block": "late"}})  # held until close() has returned
    try:
        workers.train_step(job)
        late = mgr.save(1)
        try:
            mgr.close()
            out["late_raised"] = None
        except CommitError as exc:
            out["late_raised"] = str(exc)
        out["late_still_listed"] = [j.request.generation for j in mgr.inflight.jobs]
        faults.release("late")
        late.thread.join()  # this test's process must not exit under it
    finally:
        faults.configure(None)
    out["late_gloo"] = _gloo_worker_threads()
    return out


def close_after_default_group_destroyed(rank: int, world: int, root: str) -> dict:
    """A job that destroys the default group (and with it ours) inside the ``with`` block."""
    import torch.distributed as dist

    job = workers.build("ddp", rank, world)
    before = _gloo_worker_threads()  # the default group's: the DDP model keeps it alive
    mgr = workers.manager(job, root, async_save=True)
    workers.train_step(job)
    mgr.save(1)
    dist.destroy_process_group()
    try:
        mgr.close()
        out = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - the verdict
        out = {"raised": f"{type(exc).__name__}: {exc}"}
    out.update(group_released=mgr.comm.group is None, gloo=(before, _gloo_worker_threads()),
               committed=[g.name for g in mgr.generations() if g.state == "committed"])
    # a default group again for the harness (world size 1: an in-process store suffices)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return out


def copy_before_peers_agree(rank: int, world: int, root: str) -> dict:
    """Rank 1 enters each save() only once rank 0's staging copy for it is done (a store key
    rank 0 sets from inside the copy): rank 0 can only get there if its copy runs while the
    save's agreement waits for rank 1. Then a save skipped at a busy peer drops its copy (rank
    0 has a second slot, so it copies although its previous save still waits for rank 1)."""
    from dist_ckpt.save import staging

    job = workers.build("fsdp", rank, world)
    mgr = workers.manager(job, root, async_save=True, max_in_flight=2 if rank == 0 else 1,
                          in_flight_policy="skip")
    store = mgr.comm.store
    stage = staging.StagingSlot.stage
    copied: list[int] = []

    def stage_and_signal(slot, state, *rest):
        staged = stage(slot, state, *rest)
        copied.append(len(copied) + 1)
        if rank == 0:
            store.set(f"copied-{len(copied)}", b"1")
        return staged

    staging.StagingSlot.stage = stage_and_signal
    try:
        for update in (1, 2):
            workers.train_step(job)
            if rank == 1:
                store.wait([f"copied-{update}"], timedelta(seconds=60))
            mgr.save(update)
            mgr.wait()
        # rank 1 holds its writer: its next save is in flight, so rank 0's is skipped
        faults.configure({"write.before": {"block": "held", "rank": 1}})
        workers.train_step(job)
        mgr.save(3)
        if rank == 1:
            faults.wait_reached("held")
        mgr.comm.barrier()
        workers.train_step(job)
        skipped = mgr.save(4) is None
        in_use_after_skip = sum(slot.in_use for slot in mgr.staging._slots)
        if rank == 1:
            faults.release("held")
        mgr.wait()
    finally:
        staging.StagingSlot.stage = stage
        faults.configure(None)
    committed = sorted(g.name for g in mgr.generations() if g.state == "committed")
    mgr.close()
    return {"copied": len(copied), "skipped": skipped, "in_use_after_skip": in_use_after_skip,
            "committed": committed}


def gather_frames(rank: int, world: int) -> dict:
    """Small objects travel in one frame; one rank's oversized object sends every rank
    through the object all-gather, and every rank gets every object."""
    from dist_ckpt.protocol.comm import Comm, PendingGather

    comm = Comm(timeout_s=60)
    small = comm.all_gather_start({"rank": rank}).wait()
    big_payload = b"x" * (2 * PendingGather.FRAME_BYTES) if rank == 1 else b""
    mixed = comm.all_gather_start((rank, big_payload)).wait()
    return {"small": small, "mixed": [(r, len(p)) for r, p in mixed]}
