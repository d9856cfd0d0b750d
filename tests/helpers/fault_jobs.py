"""Rank-side scenarios of the fault matrix (run through ``tests.helpers.killable.spawn``)."""

from __future__ import annotations

import os
import time

from dist_ckpt import CommitError, faults
from tests.helpers import workers


def as_nodes(rank: int, node_size: int | None) -> None:
    """Nodes of ``node_size`` ranks, described the way torchrun does (``protocol/node.py``)."""
    if node_size is not None:
        os.environ.update(LOCAL_RANK=str(rank % node_size), LOCAL_WORLD_SIZE=str(node_size),
                          RANK=str(rank))


def save_with_a_killed_rank(rank: int, world: int, root: str, point: str, victim: int,
                            deadline_s: float, node_size: int | None = None) -> dict:
    """Generation 1 commits; during the save of generation 2, ``victim`` is SIGKILLed at
    ``point``. Survivors report what their save did and how long they were held."""
    as_nodes(rank, node_size)
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


def publish_outlasting_the_deadline(rank: int, world: int, root: str, fault_dir: str,
                                    claim_first: bool) -> dict:
    """Two ranks, each its own node (rank 1 leads one). Generation 1 commits; rank 0's commit
    of generation 2 is held past the point where rank 1 stops waiting for its outcome: before
    rank 0 claims the commit (rank 1 abandons first) or after (rank 1 finds it publishing).
    Rank 0 goes on only once rank 1 reached that step."""
    from dist_ckpt.save import coordinator

    coordinator.OUTCOME_GRACE_S = 0.5  # the leaders' wait past the deadline, shortened here
    as_nodes(rank, 1)
    job = workers.build("ddp", rank, world)
    mgr = workers.manager(job, root, async_save=True, commit_timeout_s=2.0)
    workers.train_step(job)
    mgr.save(1)
    mgr.wait()
    hold, seen = ("commit.claimed", "outcome.committing") if claim_first \
        else ("commit.before_manifest", "outcome.abandoned")
    faults.configure({hold: {"rank": 0, "block": "hold"}, seen: {"rank": 1, "block": "seen"}},
                     fault_dir=fault_dir)
    workers.train_step(job)
    mgr.save(2)
    if rank == 0:
        faults.wait_reached("seen", rank=1, timeout_s=60)
        faults.release("hold")
        faults.release("seen")
    outcome: dict = {"committed": False}
    try:
        mgr.wait()
        outcome["committed"] = True
    except CommitError as exc:
        outcome["failures"] = dict(exc.failures)
    faults.configure(None)
    mgr.close()
    return outcome
