"""The compare phase's analysis and output: the side-by-side table (rows = measures, columns =
methods; median over the repetitions of the slowest rank), each target as PASS / MISS, and the
JSON section."""

from __future__ import annotations

import statistics
from typing import Any

from . import jobs
from .compare_methods import ASYNC, DCP_ASYNC, DCP_STAGED, DCP_SYNC, ORDER, OUR_EAGER, OUR_LAZY, OUR_SYNC

GiB, MiB = 1 << 30, 1 << 20
BLOCK, LOST, CPU = "save() blocking (s)", "training time lost per checkpoint (s)", \
    "CPU user + system per GiB saved (s)"
CPU_SYS, E2E, SYNC = "  of which system (s)", "save() -> durable (s)", "synchronous save (s)"
RESTORE, RESHARD = "restore, 2 ranks (s)", "restore, 2 -> 3 ranks (s)"
WRITTEN = "bytes written per save (MiB)"
SHORT = {OUR_EAGER: "ours eager", OUR_LAZY: "ours lazy", OUR_SYNC: "ours sync", DCP_SYNC: "DCP save",
         DCP_ASYNC: "DCP async", DCP_STAGED: "DCP staged"}

Cells = dict[str, dict[str, list[float]]]  # row -> method -> slowest-rank series


def slowest(ranks: list[dict[str, Any]], fn: Any) -> list[float]:
    """Per repetition, the largest of ``fn(rank_result)[i]`` over the ranks."""
    return [max(values) for values in zip(*(fn(r) for r in ranks), strict=True)]


def cpu_per_gib(rank: dict[str, Any], name: str, user_share: float = 1.0) -> list[float]:
    """CPU seconds (system, plus ``user_share`` x user) of each standalone save per GiB of state."""
    series = rank["saves"][name]
    gib = rank["state_bytes"] / GiB
    return [(user_share * user + system) / gib
            for user, system in zip(series["cpu_user"], series["cpu_sys"], strict=True)]


def cells(ranks: list[dict[str, Any]], reshard: list[dict[str, Any]]) -> Cells:
    """Every measured cell; restore rows sit in the sync columns (verified restore() under
    dist_ckpt, dcp.load under DCP save), the synchronous save row in the sync columns only."""
    out: Cells = {BLOCK: {}, LOST: {}, CPU: {}, CPU_SYS: {}, E2E: {}, SYNC: {}, RESTORE: {}, RESHARD: {},
                  WRITTEN: {}}
    for name in ranks[0]["methods"]:
        out[BLOCK][name] = slowest(ranks, lambda r, n=name: r["saves"][n]["block"])
        out[LOST][name] = slowest(ranks, lambda r, n=name: r["saves"][n]["lost"])
        out[CPU][name] = slowest(ranks, lambda r, n=name: cpu_per_gib(r, n))
        out[CPU_SYS][name] = slowest(ranks, lambda r, n=name: cpu_per_gib(r, n, user_share=0.0))
        out[E2E][name] = slowest(ranks, lambda r, n=name: r["saves"][n]["e2e"])
        out[WRITTEN][name] = slowest(ranks, lambda r, n=name: [b / MiB for b in r["saves"][n]["written"]])
        if name not in ASYNC:
            out[SYNC][name] = out[E2E][name]
    for row, results in ((RESTORE, ranks), (RESHARD, reshard)):
        if results:
            out[row][OUR_SYNC] = slowest(results, lambda r: r["restore"]["verified"])
            out[row][DCP_SYNC] = slowest(results, lambda r: r["restore"]["dcp_load"])
    return out


def quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartile (both the value itself for one value)."""
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def median_of(table: Cells, row: str, name: str) -> float | None:
    values = table.get(row, {}).get(name)
    return statistics.median(values) if values else None


# (name, numerator (row, method), denominator (row, method) or None for an absolute bound, target)
def target_specs() -> list[tuple[str, tuple[str, str], tuple[str, str] | None, float]]:
    specs: list[tuple[str, tuple[str, str], tuple[str, str] | None, float]] = []
    for ours, label in ((OUR_EAGER, "eager"), (OUR_LAZY, "lazy")):
        specs += [
            (f"time lost, {label} / DCP async staging", (LOST, ours), (LOST, DCP_STAGED), 0.5),
            (f"time lost, {label} / DCP async_save", (LOST, ours), (LOST, DCP_ASYNC), 0.5),
            (f"CPU per GiB, {label} / DCP async_save", (CPU, ours), (CPU, DCP_ASYNC), 0.5),
        ]
    specs += [
        ("blocking, lazy (s)", (BLOCK, OUR_LAZY), None, 0.02),
        ("blocking, lazy / DCP async staging", (BLOCK, OUR_LAZY), (BLOCK, DCP_STAGED), 2.0),
        ("blocking, eager / plain copy", (BLOCK, OUR_EAGER), ("copy", "copy"), 1.2),
        ("sync save, dist_ckpt / dcp.save", (SYNC, OUR_SYNC), (SYNC, DCP_SYNC), 0.9),
        ("restore, verified / dcp.load, 2 ranks", (RESTORE, OUR_SYNC), (RESTORE, DCP_SYNC), 1.3),
        ("restore, verified / dcp.load, 2 -> 3 ranks", (RESHARD, OUR_SYNC), (RESHARD, DCP_SYNC), 1.3),
    ]
    return specs


def ratios(table: Cells, copy_s: float | None) -> dict[str, dict[str, Any]]:
    """Each target: the value (ratio, or seconds for an absolute bound), the target and the
    verdict; a target whose method was not measured (no lazy snapshot) is None. The verdict
    compares ``numerator <= target x denominator``, so a denominator of 0 or less still judges."""
    out: dict[str, dict[str, Any]] = {}
    for name, (row, method), denominator, target in target_specs():
        top = median_of(table, row, method)
        if denominator is None:
            bottom: float | None = 1.0
        elif denominator[0] == "copy":
            bottom = copy_s
        else:
            bottom = median_of(table, *denominator)
        if top is None or bottom is None:
            out[name] = {"value": None, "op": "<=", "target": target, "pass": None}
            continue
        value = top / bottom if bottom > 0 else None
        out[name] = {"value": value, "op": "<=", "target": target, "pass": top <= target * bottom,
                     "numerator": top, "denominator": None if denominator is None else bottom}
    return out


def cell_text(table: Cells, row: str, name: str) -> str:
    value = median_of(table, row, name)
    return "" if value is None else f"{value:.3f}"


def print_compare(table: Cells, ratio_values: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    names = [name for name in ORDER if name in info["methods"]]
    job = ("fine-tuning: frozen base of that size, trainable state (adapters + AdamW) "
           f"{info['trainable_bytes'] / (1 << 20):.1f} MiB over both ranks"
           if info.get("job") == "finetune" else "model + AdamW state")
    print(f"\ncompare: {info['state_mib']} MiB per rank ({job}), 2 gloo ranks, "
          f"{'DDP' if info.get('kind') == 'ddp' else 'FSDP2'}, {info['repeats']} "
          f"repetitions, time lost over {info['steps']} train steps (idle {info['steps_s']:.3f} s) in "
          f"{info['lost_pairs']} pairs; "
          f"medians of the slowest rank; restores warm (page cache kept for both)")
    if OUR_LAZY not in names:
        print("  (no dist_ckpt lazy column: CheckpointConfig has no `snapshot` field yet)")
    print(f"  columns: {'; '.join(f'{SHORT[n]} = {n}' for n in names)}")
    print(f"\n{'per checkpoint':40s}" + "".join(f"{SHORT[n]:>12s}" for n in names))
    for row in table:
        print(f"{row:40s}" + "".join(f"{cell_text(table, row, n):>12s}" for n in names))
    if info.get("copy_s") is not None:
        print(f"{'plain copy into preallocated buffers (s)':40s}{info['copy_s']:12.3f}")
    print(f"noise: the {info['steps']} train steps without a save took {info['steps_min_s']:.3f} to "
          f"{info['steps_max_s']:.3f} s (median {info['steps_s']:.3f} s); allocator: {info['allocator']}")
    print(f"time lost over {info['lost_pairs']} pairs, first to third quartile (s): " + "; ".join(
        f"{SHORT[n]} {low:.3f} to {high:.3f}" for n in names
        for low, high in [info["lost_quartiles"][n]]))
    print(f"\n{'compare target':46s} {'ours':>8s} {'ref':>8s} {'value':>8s} {'target':>9s}  result")
    for name, item in ratio_values.items():
        value = "n/a" if item["value"] is None else f"{item['value']:.3f}"
        ours = "" if item.get("numerator") is None else f"{item['numerator']:.3f}"
        ref = "" if item.get("denominator") is None else f"{item['denominator']:.3f}"
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[item["pass"]]
        print(f"{name:46s} {ours:>8s} {ref:>8s} {value:>8s} {'<=':>3s} {item['target']:5.2f}  {verdict}")


Targets = dict[str, dict[str, Any]]


def analyse(raw: dict[str, Any], cfg: dict[str, Any]) -> tuple[Cells, Targets, dict[str, Any]]:
    """The table, the targets and the header facts of a compare run."""
    ranks, reshard = raw["ranks"], raw["reshard"]
    table = cells(ranks, reshard)
    copy = slowest(ranks, lambda r: r["copy"])
    without = slowest(ranks, lambda r: [v for n in r["methods"] for v in r["saves"][n]["steps_without"]])
    info = {"state_mib": cfg["state_mib"], "repeats": cfg["repeats"], "steps": cfg["steps"],
            "methods": ranks[0]["methods"], "copy_s": statistics.median(copy),
            "steps_s": statistics.median(without), "steps_min_s": min(without),
            "steps_max_s": max(without), "lazy": ranks[0]["lazy"],
            "lost_pairs": len(table[LOST][ranks[0]["methods"][0]]),
            "lost_quartiles": {name: quartiles(values) for name, values in table[LOST].items()},
            "allocator": cfg.get("allocator", "glibc default"),
            "state_bytes": ranks[0]["state_bytes"], "generation": ranks[0]["generation"],
            "job": cfg.get("job", "full"), "kind": cfg.get("kind", "fsdp"),
            "trainable_bytes": sum(r["trainable_bytes"] for r in ranks)}
    return table, ratios(table, info["copy_s"]), info


def document(raw: dict[str, Any], table: Cells, ratio_values: dict[str, dict[str, Any]],
             info: dict[str, Any]) -> dict[str, Any]:
    """The ``compare`` section of the JSON document."""
    return {
        "info": info,
        "table": {row: {name: {**jobs.summary(values), "values": values} for name, values in by.items()}
                  for row, by in table.items()},
        "targets": ratio_values,
        "per_rank": raw["ranks"], "reshard": raw["reshard"],
        "profile_cpu": raw["ranks"][0].get("profile_cpu"),
    }
