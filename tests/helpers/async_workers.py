"""Asynchronous-save scenarios run inside spawned ranks."""

from __future__ import annotations

import os
import threading
import time

from dist_ckpt import CommitError, faults
from dist_ckpt.save.staging import local_tensors
from tests.helpers import workers

DEADLINE_S = 4.0


def _latest(root: str) -> bytes:
    with open(os.path.join(root, "latest.json"), "rb") as handle:
        return handle.read()


def _timed_save(mgr, update: int) -> float:
    started = time.perf_counter()
    mgr.save(update)
    return time.perf_counter() - started


def _expect_failure(mgr) -> tuple[str | None, dict[int, str], float]:
    started = time.perf_counter()
    try:
        mgr.wait()
    except CommitError as exc:
        return exc.generation, exc.failures, time.perf_counter() - started
    raise AssertionError("expected a CommitError")


def slow_and_failing_ranks(rank: int, world: int, root: str) -> dict:
    job = workers.build("fsdp", rank, world)
    mgr = workers.manager(job, root, async_save=True, max_in_flight=1, commit_timeout_s=DEADLINE_S)
    out: dict = {}
    workers.train_step(job)
    mgr.save(1)
    mgr.wait()

    faults.configure({"write.before": {"rank": 1, "delay_s": 1.5}})  # below the deadline
    workers.train_step(job)
    out["below_blocked_s"] = _timed_save(mgr, 2)
    mgr.wait()
    latest_before = _latest(root) if rank == 0 else b""

    faults.configure({"write.before": {"rank": 1, "delay_s": DEADLINE_S + 2}})  # above it
    workers.train_step(job)
    out["above_blocked_s"] = _timed_save(mgr, 3)
    out["above"] = _expect_failure(mgr)
    if rank == 0:
        out["latest_unchanged"] = _latest(root) == latest_before
        out["entries_after_above"] = sorted(os.listdir(root))

    faults.configure(None)
    workers.train_step(job)
    mgr.save(4)
    mgr.wait()

    faults.configure({"write.before": {"rank": 1, "raise": True}})  # crashed writer
    workers.train_step(job)
    out["crash_blocked_s"] = _timed_save(mgr, 5)
    out["crash"] = _expect_failure(mgr)

    faults.configure({"report.before": {"rank": 1, "delay_s": DEADLINE_S + 2}})  # missing report
    workers.train_step(job)
    out["missing_blocked_s"] = _timed_save(mgr, 6)
    workers.train_step(job)
    try:  # the failure surfaces at the next save() on every rank, which does not save
        mgr.save(7)
        out["next_save_raised"] = None
    except CommitError as exc:
        out["next_save_raised"] = (exc.generation, exc.failures)
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
    out: dict = {}
    faults.configure({"write.before": {"delay_s": 1.5}})  # a slow writer on every rank
    for policy, slots in (("block", 1), ("skip", 1), ("block", 2)):
        job = workers.build("fsdp", rank, world)
        sub = os.path.join(root, f"{policy}{slots}")
        mgr = workers.manager(job, sub, async_save=True, max_in_flight=slots, in_flight_policy=policy)
        workers.train_step(job)
        first = _timed_save(mgr, 1)
        workers.train_step(job)
        started = time.perf_counter()
        second = mgr.save(2)
        out[(policy, slots)] = {
            "first_s": first, "second_s": time.perf_counter() - started,
            "second_skipped": second is None, "skipped": mgr.stats.skipped,
            "peak": mgr.staging.peak_bytes, "allocations": mgr.staging.allocations,
            "state_bytes": _local_state_bytes(job),
        }
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
                    "jobs": len(mgr._jobs), "group_released": mgr.comm.group is None}

    mgr = workers.manager(job, os.path.join(root, "late"), async_save=True, close_timeout_s=0.2)
    faults.configure({"write.before": {"delay_s": 1.5}})
    try:
        workers.train_step(job)
        late = mgr.save(1)
        try:
            mgr.close()
            out["late_raised"] = None
        except CommitError as exc:
            out["late_raised"] = str(exc)
        out["late_still_listed"] = [j.request.generation for j in mgr._jobs]
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
