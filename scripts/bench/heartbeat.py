"""The cost of a progress call with nothing pending (issue 26: under 50 µs per call).

One rank (its own process, a 1-rank gloo group): ``heartbeat(u)`` and ``maybe_save(u)`` with a
``save_every`` that never comes, ``CALLS`` calls per repetition, each figure the median of the
repetitions' per-call means. Twice: outside the launcher (no marks file, no preemption watch)
and under a simulated launcher directory (``DIST_CKPT_LAUNCH_DIR``: the mapped marks file is
written at every call, the preemption watch polls for a notice that never comes).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

CALLS = 100_000
TARGET_US = 50.0
PLACES = ("outside the launcher", "under a launcher directory")


def _per_call_us(call: Any, first: int, repeats: int) -> tuple[float, int]:
    means = []
    for _ in range(repeats):
        started = time.perf_counter()
        for update in range(first, first + CALLS):
            call(update)
        means.append((time.perf_counter() - started) / CALLS * 1e6)
        first += CALLS
    return statistics.median(means), first


def rank_heartbeat(rank: int, world: int, cfg: dict[str, Any], base: str) -> dict[str, dict[str, float]]:
    import torch

    from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
    from dist_ckpt.launcher_api import LAUNCH_DIR_ENV

    out: dict[str, dict[str, float]] = {}
    for place in PLACES:
        if place == PLACES[1]:
            os.environ[LAUNCH_DIR_ENV] = os.path.join(base, "heartbeat-start")
        model = torch.nn.Linear(4, 4)
        state = TrainState(model, torch.optim.AdamW(model.parameters()))
        config = CheckpointConfig(root=os.path.join(base, f"heartbeat-{len(out)}"), save_every=10**12)
        with CheckpointManager(config, state) as mgr:
            mgr.restore()
            update = 1
            out[place] = {}
            for name in ("heartbeat", "maybe_save"):
                out[place][name], update = _per_call_us(getattr(mgr, name), update, cfg["repeats"])
        os.environ.pop(LAUNCH_DIR_ENV, None)
    return out


def print_costs(costs: dict[str, dict[str, float]]) -> None:
    print(f"\nprogress calls with nothing pending (median of per-call means, {CALLS} calls each; "
          f"target < {TARGET_US:.0f} µs)")
    for place, calls in costs.items():
        for name, micros in calls.items():
            verdict = "PASS" if micros < TARGET_US else "MISS"
            print(f"  {name + '()':<13} {place:<28} {micros:8.2f} µs  {verdict}")
