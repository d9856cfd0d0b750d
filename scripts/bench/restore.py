"""Restore: ``restore()`` at 2 ranks vs a raw read of the same files, and at 3 ranks (reshard)
of the generation the 2-rank run left (model sized for 2 ranks)."""

from __future__ import annotations

from typing import Any

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs
from .context import Ctx
from .profiling import profile_call
from .rawio import generation_files, raw_read


def phase_restore(ctx: Ctx, root: str) -> dict[str, list[float]]:
    """mgr.restore() at this world size, each followed by a raw read of the same files."""
    _, files, _ = generation_files(root)
    out: dict[str, list[float]] = {"restore": [], "read": []}
    with CheckpointManager(CheckpointConfig(root=root), ctx.state) as mgr:
        mgr.restore()  # warm-up: page cache and first-call costs, not measured
        for _ in range(ctx.repeats):
            jobs.barrier()
            out["restore"].append(jobs.timed(mgr.restore))
            jobs.barrier()
            out["read"].append(raw_read(files, ctx.rank, ctx.world))
        jobs.barrier()
        ctx.profiled("restore() rank 0, 2 ranks", mgr.restore)
    return out


def rank_reshard(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Restore, at ``world`` ranks, the generation a 2-rank run left (model sized for 2 ranks)."""
    import torch

    torch.set_num_threads(1)
    _, _, state = jobs.build_job_sized(cfg["state_mib"], rank, world, size_world=2)
    times: list[float] = []
    profiles: dict[str, str] = {}
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        generation = mgr.restore().generation  # warm-up, not measured
        for _ in range(cfg["repeats"]):
            jobs.barrier()
            times.append(jobs.timed(mgr.restore))
        if cfg["profile"] and rank == 0:
            _, profiles[f"restore() rank 0, {world} ranks"] = profile_call(mgr.restore)
        elif cfg["profile"]:
            mgr.restore()
    return {"restore": times, "generation": generation, "profiles": profiles}
