"""Rank bodies for the preemption tests (run with ``dist_ckpt.testing.run_ranks``): training
under a simulated launcher directory (``DIST_CKPT_LAUNCH_DIR``) where rank 0 writes the
launcher's notice file at one update, as the launcher would."""

from __future__ import annotations

import os
import time
from typing import Any

from dist_ckpt import faults, runinfo
from dist_ckpt.errors import Preempted
from dist_ckpt.storage.local import atomic_write
from tests.helpers.memory_jobs import _env as memory_env
from tests.helpers.workers import build, full_state, manager, train_step

TOKENS_PER_UPDATE = 10
NEVER = 1_000_000  # save_every far beyond any run here: only the preemption saves


def train_until_preempted(rank: int, world: int, root: str, launch_dir: str, notice_at: int,
                          limit: int, call: str = "maybe_save", memory: tuple[str, str] | None = None,
                          config: dict[str, Any] | None = None,
                          fault_spec: dict[str, dict[str, Any]] | None = None) -> dict:
    """Train up to ``limit`` updates, calling ``call`` (maybe_save or heartbeat) after each;
    rank 0 writes the notice after update ``notice_at``. Returns what ``Preempted`` said
    (None: never preempted) and the gathered state at that point (rank 0)."""
    os.environ[runinfo.LAUNCH_DIR_ENV] = launch_dir
    if memory is not None:
        memory_env(*memory)
    faults.configure(fault_spec)
    job = build("fsdp", rank, world)
    preempted: Preempted | None = None
    reached = None
    try:
        with manager(job, root, **{"save_every": NEVER, **(config or {})}) as mgr:
            for update in range(mgr.restore().next_update, limit):
                train_step(job)
                reached = update + 1
                if rank == 0 and reached == notice_at:
                    atomic_write(runinfo.preempt_notice_path(), b"test notice")
                getattr(mgr, call)(reached, tokens_seen=TOKENS_PER_UPDATE * reached)
    except Preempted as stop:
        preempted = stop
    return {"generation": None if preempted is None else preempted.generation,
            "update": None if preempted is None else preempted.update,
            "code": None if preempted is None else preempted.code, "reached": reached,
            "skipped": mgr.stats.skipped, "full": full_state(job)}


def restore(rank: int, world: int, root: str, memory: tuple[str, str] | None = None) -> dict:
    if memory is not None:
        memory_env(*memory)
    job = build("fsdp", rank, world, seed=99)
    with manager(job, root, memory_tier=memory is not None) as mgr:
        result = mgr.restore()
    return {"generation": result.generation, "next_update": result.next_update, "full": full_state(job)}


def finish_under_notice(rank: int, world: int, root: str, launch_dir: str, steps: int) -> dict:
    """Train ``steps - 1`` updates; once every rank has seen a notice, agree on the target
    ``steps`` (a heartbeat at ``steps - 1``), train the last update and ``finish(steps)``: a
    run that ends under a preemption notice writes its DONE record instead of stopping."""
    os.environ[runinfo.LAUNCH_DIR_ENV] = launch_dir
    job = build("fsdp", rank, world)
    with manager(job, root, save_every=NEVER) as mgr:
        for update in range(steps - 1):
            train_step(job)
            mgr.maybe_save(update + 1)
        if rank == 0:
            atomic_write(runinfo.preempt_notice_path(), b"test notice")
        deadline = time.monotonic() + 30
        while not mgr.preemption.noticed:  # the watch thread's poll, bounded
            assert time.monotonic() < deadline, "the notice was never seen"
            time.sleep(0.01)
        mgr.heartbeat(steps - 1)
        assert mgr.preemption.target == steps
        train_step(job)
        try:
            done = mgr.finish(steps)
        except Preempted as stop:
            return {"done": None, "preempted": stop.generation}
    return {"done": done.generation, "preempted": None}
