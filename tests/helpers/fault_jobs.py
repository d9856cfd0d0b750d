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
