"""Interference: train step time with no save in flight vs while an async save (write, hash,
commit) runs in the manager's background thread."""

from __future__ import annotations

import os
from typing import Any

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs
from .context import Ctx


def steps_while(ctx: Ctx, job: Any, limit: int) -> list[float]:
    """Train steps until any rank's ``job`` is done (None: ``limit`` steps); only steps are timed.

    One tiny all-reduce per step keeps the ranks' step counts equal (FSDP steps are collective).
    """
    import torch
    import torch.distributed as dist

    times: list[float] = []
    flag = torch.zeros(1)
    while len(times) < limit:
        flag[0] = 1.0 if job is not None and job.done.is_set() else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        times.append(jobs.timed(ctx.step))
    return times


def saves_in_flight(ctx: Ctx, mgr: CheckpointManager, wanted: int, out: dict[str, list]) -> int:
    """At least ``repeats`` async saves, and more (up to 4x) until ``wanted`` steps ran while
    one was in flight; returns the last update saved."""
    update = 1
    while update <= ctx.repeats or (len(out["inflight"]) < wanted and update <= 4 * ctx.repeats):
        update += 1
        jobs.barrier()
        job = mgr.save(update)
        steps = steps_while(ctx, job, 10_000)
        out["inflight"].extend(steps)
        out["steps_per_save"].append(len(steps))
        mgr.wait()  # step counts agree across ranks (steps_while), so does the loop
    return update


def phase_interference(ctx: Ctx) -> dict[str, list]:
    """Step time with no save in flight vs while an async save (write, hash, commit) runs."""
    root = os.path.join(ctx.base, "interference")
    out: dict[str, list] = {"idle": [], "inflight": [], "steps_per_save": []}
    wanted = max(10, 3 * ctx.repeats)
    steps_while(ctx, None, 2)  # warm-up
    out["idle"] = steps_while(ctx, None, wanted)
    config = CheckpointConfig(root=root, async_save=True, keep_last=2)
    with CheckpointManager(config, ctx.state) as mgr:
        mgr.save(1)  # first save allocates the staging buffers: not measured
        mgr.wait()
        update = saves_in_flight(ctx, mgr, wanted, out)
        if ctx.cfg["profile"]:  # one more step each way, not measured, under cProfile on rank 0
            ctx.profiled("train step rank 0, no save in flight", ctx.step, sort="tottime")
            mgr.save(update + 1)
            ctx.profiled("train step rank 0, async save in flight", ctx.step, sort="tottime")
            mgr.wait()
    out["idle"].extend(steps_while(ctx, None, wanted))
    ctx.drop(root)
    return out
