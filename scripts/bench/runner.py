"""What runs where: the main 2-rank run (saves, restore, interference in one job), the
3-rank reshard run, the two memory runs (fresh processes each), the commit scale here, and the
compare runs (2 ranks, then 3 for its reshard; fresh processes). ``cfg["phases"]`` selects."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

from .commit_scale import commit_scale
from .compare import rank_compare, rank_compare_reshard
from .context import Ctx
from .heartbeat import rank_heartbeat
from .interference import phase_interference
from .mirror import moto_server
from .restore import phase_restore, rank_reshard
from .rss import rank_rss
from .saves import phase_saves

RUN_TIMEOUT_S = 3600
PHASES = ("saves", "restore", "interference", "memory", "commit_scale", "heartbeat", "compare")
OPT_IN_PHASES = ("scale",)  # run only when named: simulated ranks against one store (scale.py)
MAIN_PHASES = ("saves", "restore", "interference")  # one 2-rank job; restore reads what saves left


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
    phases = cfg["phases"]
    if "saves" in phases:
        out["saves"] = phase("saves, raw write, DCP", lambda: phase_saves(ctx))
    if "restore" in phases:
        out["restore"] = phase("restore", lambda: phase_restore(ctx, os.path.join(base, "ours-sync")))
    if "interference" in phases:
        out["interference"] = phase("interference", lambda: phase_interference(ctx))
    out["walls"], out["profiles"] = walls, ctx.profiles
    return out


# glibc hands every freed block above its mmap threshold (at most 32 MiB) back to the kernel,
# so without this each train step of the bench job faults its gradients and FSDP's gathered
# parameters in afresh, and the step times spread more than any save costs, so no save's cost
# shows through (figures: docs/performance.md).
# Kept freed memory is what a caching allocator (CUDA's, jemalloc, tcmalloc) gives a real job.
CACHING_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def rank_environment(cfg: dict[str, Any]) -> AbstractContextManager:
    """The environment the compare ranks start with (spawned processes read it at start),
    restored afterwards."""
    return mock.patch.dict(os.environ, CACHING_MALLOC_ENV if cfg.get("allocator") == "caching" else {})


def run_compare(cfg: dict[str, Any], base: str, timed_run: Callable[[str, Callable[[], Any]], Any]
                ) -> dict[str, Any]:
    """The compare phase: its 2-rank run, then the 3-rank restore of the generation it left,
    both with the allocator ``cfg["allocator"]`` names. The fine-tuning job runs beside a moto
    S3 server of its own (``mirror.moto_server``; the mirror-bytes row) unless ``cfg["mirror"]``
    is False (``--no-mirror``) or ``moto_server`` is not installed."""
    with rank_environment(cfg):
        if cfg.get("job") != "finetune" or cfg.get("mirror") is False:
            return _run_compare({**cfg, "mirror": None}, base, timed_run)
        with moto_server() as bucket:
            if bucket is None:
                print("[bench] moto_server not found: no mirror-bytes row", flush=True)
            return _run_compare({**cfg, "mirror": bucket}, base, timed_run)


def _run_compare(cfg: dict[str, Any], base: str, timed_run: Callable[[str, Callable[[], Any]], Any]
                 ) -> dict[str, Any]:
    from dist_ckpt.testing import run_ranks

    ranks = timed_run("compare run (2 ranks)",
                      lambda: run_ranks(2, rank_compare, cfg, base, timeout_s=RUN_TIMEOUT_S))
    root = ranks[0]["sync_root"]
    reshard = timed_run("compare reshard run (3 ranks)", lambda: run_ranks(
        3, rank_compare_reshard, cfg, root, timeout_s=RUN_TIMEOUT_S))
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)
    return {"ranks": ranks, "reshard": reshard}


def run_all(cfg: dict[str, Any], base: str, walls: dict[str, float]) -> dict[str, Any]:
    """Every run, in order; ``walls`` gets the wall time of each."""
    from dist_ckpt.testing import run_ranks

    def timed_run(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = fn()
        walls[name] = time.perf_counter() - started
        print(f"[bench] {name}: {walls[name]:.1f} s", flush=True)
        return result

    phases = cfg["phases"]
    out: dict[str, Any] = {"main": [], "reshard": [], "memory": {}, "scale": {}, "profiles": {}}
    if any(p in phases for p in MAIN_PHASES):
        out["main"] = timed_run("main run (2 ranks)",
                                lambda: run_ranks(2, rank_main, cfg, base, timeout_s=RUN_TIMEOUT_S))
        out["profiles"].update(out["main"][0]["profiles"])
    if "restore" in phases:
        out["reshard"] = timed_run("reshard run (3 ranks)", lambda: run_ranks(
            3, rank_reshard, cfg, os.path.join(base, "ours-sync"), timeout_s=RUN_TIMEOUT_S))
        out["profiles"].update(out["reshard"][0]["profiles"])
    shutil.rmtree(os.path.join(base, "ours-sync"), ignore_errors=True)
    if "memory" in phases:
        out["memory"] = {slots: timed_run(f"memory run K={slots} (2 ranks)", lambda s=slots: run_ranks(
            2, rank_rss, cfg, base, s, timeout_s=RUN_TIMEOUT_S)) for slots in (1, 2)}
    if "commit_scale" in phases:
        out["scale"], scale_profiles = timed_run(
            "commit scale (1 process)", lambda: commit_scale(base, cfg["repeats"], cfg["profile"]))
        out["profiles"].update(scale_profiles)
    if "heartbeat" in phases:
        out["heartbeat"] = timed_run("heartbeat (1 rank)", lambda: run_ranks(
            1, rank_heartbeat, cfg, base, timeout_s=RUN_TIMEOUT_S))[0]
    if "compare" in phases:
        out["compare"] = run_compare(cfg, base, timed_run)
    if "scale" in phases:
        # imported here: the scale adapter drives protocol modules an older library (a compare
        # run of the baseline's commit, docs/performance.md) does not have
        from .scale import phase_scale

        out["scale_cases"] = timed_run("scale (simulated ranks, one store)", lambda: phase_scale(cfg))
    return out
