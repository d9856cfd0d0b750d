"""Rank-side scenarios of the fault matrix (run through ``tests.helpers.killable.spawn``)."""

from __future__ import annotations

import time

from dist_ckpt import CommitError, faults
from tests.helpers import workers


def save_with_a_killed_rank(rank: int, world: int, root: str, point: str, victim: int,
                            deadline_s: float) -> dict:
    """Generation 1 commits; during the save of generation 2, ``victim`` is SIGKILLed at
    ``point``. Survivors report what their save did and how long they were held."""
    job = workers.build("ddp", rank, world)
    mgr = workers.manager(job, root, async_save=True, commit_timeout_s=deadline_s)
    workers.train_step(job)
    mgr.save(1)
    mgr.wait()
    faults.configure({point: {"rank": victim, "kill": True}})
    workers.train_step(job)
    started = time.monotonic()
    outcome: dict = {"committed": False, "failures": None}
    try:
        mgr.save(2)
        mgr.wait()
        outcome["committed"] = True
    except CommitError as exc:
        outcome["failures"] = dict(exc.failures)
    outcome["held_s"] = time.monotonic() - started
    faults.configure(None)
    mgr.close()
    return outcome


def restore_only(rank: int, world: int, root: str) -> dict:
    """A restarted job: what ``restore()`` loaded and rejected (all ranks agree)."""
    job = workers.build("ddp", rank, world)
    mgr = workers.manager(job, root)
    result = mgr.restore()
    mgr.close()
    return {"generation": result.generation, "rejected": [str(p) for p in result.rejected]}


def slow_disk(rank: int, world: int, root: str, deadline_s: float, request_delay_s: float,
              saves: int) -> dict:
    """Rank 1's every write request takes ``request_delay_s`` from the middle of the first
    save on, for the rest of the run; every rank trains and saves each update (``block``
    policy, one save in flight) and records how long each ``save()`` held it and which
    generations failed."""
    job = workers.build("ddp", rank, world)
    mgr = workers.manager(job, root, async_save=True, max_in_flight=1, in_flight_policy="block",
                          commit_timeout_s=deadline_s)
    faults.configure({"write.request": {"rank": 1, "after": 2, "delay_s": request_delay_s}})
    held, failed = [], []
    for update in range(1, saves + 1):
        workers.train_step(job)
        started = time.monotonic()
        try:
            mgr.save(update)
        except CommitError as exc:  # an earlier generation failed: reported, training goes on
            failed.append(exc.generation)
            mgr.save(update)
        held.append(time.monotonic() - started)
    started = time.monotonic()
    try:
        mgr.wait()
    except CommitError as exc:
        failed.append(exc.generation)
    held.append(time.monotonic() - started)
    faults.configure(None)
    committed = [g.name for g in mgr.generations() if g.state == "committed"]
    mgr.close()
    return {"held": held, "failed": failed, "committed": committed, "steps": len(job.losses)}
