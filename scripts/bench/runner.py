"""What runs where: the main 2-rank run (saves, restore, interference in one job), the
3-rank reshard run, the two memory runs (fresh processes each) and the commit scale here."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from .commit_scale import commit_scale
from .context import Ctx
from .interference import phase_interference
from .memory import rank_memory
from .restore import phase_restore, rank_reshard
from .saves import phase_saves

RUN_TIMEOUT_S = 3600


def rank_main(rank: int, world: int, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    """One rank of the main run: the phases in order, each one's wall time."""
    ctx = Ctx(rank, world, cfg, base)
    walls: dict[str, float] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = fn()
        walls[name] = time.perf_counter() - started
        return result

    out: dict[str, Any] = {"rank": rank, "state_bytes": ctx.state_bytes}
    out["saves"] = phase("saves, raw write, DCP", lambda: phase_saves(ctx))
    out["restore"] = phase("restore", lambda: phase_restore(ctx, os.path.join(base, "ours-sync")))
    out["interference"] = phase("interference", lambda: phase_interference(ctx))
    out["walls"], out["profiles"] = walls, ctx.profiles
    return out


def run_all(cfg: dict[str, Any], base: str, walls: dict[str, float]) -> dict[str, Any]:
    """Every run, in order; ``walls`` gets the wall time of each."""
    from dist_ckpt.testing import run_ranks

    def timed_run(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = fn()
        walls[name] = time.perf_counter() - started
        print(f"[bench] {name}: {walls[name]:.1f} s", flush=True)
        return result

    main = timed_run("main run (2 ranks)",
                     lambda: run_ranks(2, rank_main, cfg, base, timeout_s=RUN_TIMEOUT_S))
    reshard = timed_run("reshard run (3 ranks)", lambda: run_ranks(
        3, rank_reshard, cfg, os.path.join(base, "ours-sync"), timeout_s=RUN_TIMEOUT_S))
    shutil.rmtree(os.path.join(base, "ours-sync"), ignore_errors=True)
    memory = {slots: timed_run(f"memory run K={slots} (2 ranks)", lambda s=slots: run_ranks(
        2, rank_memory, cfg, base, s, timeout_s=RUN_TIMEOUT_S)) for slots in (1, 2)}
    scale, scale_profiles = timed_run("commit scale (1 process)",
                                      lambda: commit_scale(base, cfg["repeats"], cfg["profile"]))
    profiles = {**main[0]["profiles"], **reshard[0]["profiles"], **scale_profiles}
    return {"main": main, "reshard": reshard, "memory": memory, "scale": scale, "profiles": profiles}
