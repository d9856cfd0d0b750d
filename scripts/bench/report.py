"""Analysis and output: the timed series (slowest rank per repetition), the ratios against
their targets, the printed table and the JSON document."""

from __future__ import annotations

import statistics
from typing import Any

from . import jobs
from .commit_scale import SCALE_RANKS

# name -> (operator, target); the ratios are computed in ``ratios``
TARGETS: dict[str, tuple[str, float]] = {
    "stall (async block / sync block)": ("<=", 0.10),
    "staging efficiency (async block / copy)": ("<=", 1.5),
    "write efficiency (commit thrpt / raw write thrpt)": (">=", 0.85),
    "our async block / DCP async_save block": ("<=", 0.25),
    "our end-to-end / DCP sync save": ("<=", 1.2),
    "restore efficiency (restore thrpt / raw read thrpt)": (">=", 0.8),
    "reshard overhead (restore 3 ranks / 2 ranks)": ("<=", 1.25),
    "interference (step in flight / idle step)": ("<=", 1.10),
    "peak RSS K=1 / (baseline + 1 x state)": ("<=", 1.10),
    "peak RSS K=2 / (baseline + 2 x state)": ("<=", 1.10),
    "commit of 4096 reports (s)": ("<", 1.0),
}

Rows = dict[str, list[float]]
Memory = dict[int, list[dict[str, Any]]]


def slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(values) for values in zip(*per_rank, strict=True)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def series(main: list[dict[str, Any]], *keys: str, rank: int | None = None) -> list[float]:
    """``main[rank][keys...]``, or the slowest rank per repetition when ``rank`` is None."""
    def one(result: dict[str, Any]) -> list[float]:
        value: Any = result
        for key in keys:
            value = value[key]
        return list(value)

    return one(main[rank]) if rank is not None else slowest([one(r) for r in main])


def save_rows(main: list[dict[str, Any]]) -> Rows:
    """The saves phase, first saves split off."""
    rows: Rows = {}
    for mode in ("async", "sync"):
        block = series(main, "saves", mode, "block")
        rows[f"our {mode} save() blocking, first"], rows[f"our {mode} save() blocking"] = block[:1], block[1:]
    rows["plain copy into preallocated buffers"] = series(main, "saves", "copy")[1:]
    e2e = series(main, "saves", "async", "e2e", rank=0)
    rows["our async commit, save() -> wait() rank 0, first"] = e2e[:1]
    rows["our async commit, save() -> wait() rank 0"] = e2e[1:]
    rows["our sync save() rank 0"] = series(main, "saves", "sync", "e2e", rank=0)[1:]
    rows["raw write + fsync of the generation bytes"] = series(main, "saves", "raw_write")[1:]
    for key, label in (("dcp_async_block", "DCP async_save blocking"),
                       ("dcp_async_e2e", "DCP async_save end-to-end"), ("dcp_sync", "DCP save (sync)")):
        values = series(main, "saves", key)
        rows[f"{label}, first"], rows[label] = values[:1], values[1:]
    return rows


def timing_rows(main: list[dict[str, Any]], reshard: list[dict[str, Any]],
                scale: dict[int, list[float]]) -> Rows:
    """Every timed series (seconds), first saves split off, slowest rank per repetition; only
    those of the phases that ran."""
    ran = set(main[0]) if main else set()
    rows = save_rows(main) if "saves" in ran else {}
    if "restore" in ran:
        rows["our restore(), 2 ranks"] = series(main, "restore", "restore")
        rows["raw read of the generation files, 2 ranks"] = series(main, "restore", "read")
    if reshard:
        rows["our restore(), 3 ranks"] = slowest([r["restore"] for r in reshard])
    if "interference" in ran:
        rows["train step, no save in flight (rank 0)"] = series(main, "interference", "idle", rank=0)
        rows["train step, async save in flight (rank 0)"] = series(main, "interference", "inflight",
                                                                   rank=0)
    for world_size, values in scale.items():
        rows[f"commit of {world_size} simulated reports"] = values
    return rows


def ratios(rows: Rows, memory: Memory) -> dict[str, float]:
    """Each target's value, for the targets whose series were measured (phases that ran)."""
    our_block, our_e2e = "our async save() blocking", "our async commit, save() -> wait() rank 0"
    restore2 = "our restore(), 2 ranks"
    quotients = {
        "stall (async block / sync block)": (our_block, "our sync save() blocking"),
        "staging efficiency (async block / copy)": (our_block, "plain copy into preallocated buffers"),
        "write efficiency (commit thrpt / raw write thrpt)":
            ("raw write + fsync of the generation bytes", our_e2e),
        "our async block / DCP async_save block": (our_block, "DCP async_save blocking"),
        "our end-to-end / DCP sync save": (our_e2e, "DCP save (sync)"),
        "restore efficiency (restore thrpt / raw read thrpt)":
            ("raw read of the generation files, 2 ranks", restore2),
        "reshard overhead (restore 3 ranks / 2 ranks)": ("our restore(), 3 ranks", restore2),
        "interference (step in flight / idle step)":
            ("train step, async save in flight (rank 0)", "train step, no save in flight (rank 0)"),
    }
    out = {name: median(rows[top]) / median(rows[bottom])
           for name, (top, bottom) in quotients.items() if top in rows and bottom in rows}
    largest = f"commit of {SCALE_RANKS[-1]} simulated reports"
    if largest in rows:
        out["commit of 4096 reports (s)"] = median(rows[largest])
    for slots, results in memory.items():
        out[f"peak RSS K={slots} / (baseline + {slots} x state)"] = max(
            r["peak"] / (r["baseline"] + slots * r["state_bytes"]) for r in results)
    return out


def passes(name: str, value: float) -> bool:
    op, target = TARGETS[name]
    return {"<=": value <= target, ">=": value >= target, "<": value < target}[op]


def print_table(rows: Rows, ratio_values: dict[str, float], memory: Memory) -> None:
    """The timing table, the memory table and the ratios, each where its phases ran."""
    mib = jobs.MiB
    if rows:
        print(f"\n{'timing (s; slowest rank per repetition unless noted)':58s} {'median':>9s} "
              f"{'min':>9s} {'max':>9s} {'n':>4s}")
    for name, values in rows.items():
        print(f"{name:58s} {median(values):9.4f} {min(values):9.4f} {max(values):9.4f} {len(values):4d}")
    if memory:
        print(f"\n{'memory (MiB)':30s} {'rank':>4s} {'baseline':>9s} {'state':>8s} {'staging':>8s} "
              f"{'expected':>9s} {'peak':>8s}")
    for slots, results in memory.items():
        for rank, r in enumerate(results):
            expected = r["baseline"] + slots * r["state_bytes"]
            print(f"{f'async, max_in_flight={slots}':30s} {rank:4d} {r['baseline'] / mib:9.0f} "
                  f"{r['state_bytes'] / mib:8.0f} {r['staging_peak'] / mib:8.0f} "
                  f"{expected / mib:9.0f} {r['peak'] / mib:8.0f}")
    if ratio_values:
        print(f"\n{'ratio':54s} {'value':>8s} {'target':>9s}  result")
    for name, value in ratio_values.items():
        op, target = TARGETS[name]
        print(f"{name:54s} {value:8.3f} {op:>3s} {target:5.2f}  {'PASS' if passes(name, value) else 'MISS'}")


def print_saves_per_rank(main: list[dict[str, Any]]) -> None:
    """Each rank's own medians of the blocking times (the table shows the slowest rank per
    repetition), first saves left out, and its two quotients: one rank's imbalance shows here."""
    if not main or "saves" not in main[0]:
        return
    print(f"\n{'saves, per rank (median s, first save apart)':46s} {'async':>8s} {'sync':>8s} "
          f"{'copy':>8s} {'async/sync':>11s} {'async/copy':>11s}")
    for rank in range(len(main)):
        block = {mode: series(main, "saves", mode, "block", rank=rank) for mode in ("async", "sync")}
        async_s, sync_s = median(block["async"][1:]), median(block["sync"][1:])
        copy_s = median(series(main, "saves", "copy", rank=rank)[1:])
        first = f"first async {block['async'][0]:.3f}, sync {block['sync'][0]:.3f}"
        print(f"{f'rank {rank} ({first})':46s} {async_s:8.4f} {sync_s:8.4f} {copy_s:8.4f} "
              f"{async_s / sync_s:11.3f} {async_s / copy_s:11.3f}")


def document(raw: dict[str, Any], cfg: dict[str, Any], walls: dict[str, float], rows: Rows,
             ratio_values: dict[str, float]) -> dict[str, Any]:
    """The JSON document (same keys as the single-file benchmark wrote)."""
    return {
        "machine": jobs.machine(), "config": cfg, "walls_s": walls,
        "timings_s": {name: {**jobs.summary(values), "values": values} for name, values in rows.items()},
        "ratios": {name: {"value": value, "op": TARGETS[name][0], "target": TARGETS[name][1],
                          "pass": passes(name, value)} for name, value in ratio_values.items()},
        "memory": {str(k): v for k, v in raw["memory"].items()},
        "per_rank": raw["main"], "reshard": raw["reshard"], "profiles": raw["profiles"],
    }
