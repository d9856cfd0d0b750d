"""The compare phase's analysis and output: the side-by-side table (rows = measures, columns =
methods; median over the repetitions of the slowest rank), each target as PASS / MISS, and the
JSON section.

Issue 28's targets (``issue28_specs``; printed as met / not met): for the fine-tuning job,
bytes written and mirror bytes uploaded per generation after the first <= 1.05 x the trainable
state (its tensors, replicated ones once, plus the small state: the generation's files other
than tensor data), incremental ``save()`` blocking and save CPU <= 0.1 x a full save's
(``incremental=False``), incremental time to durable <= 0.1 x DCP ``async_save``'s, restore of
an incremental generation <= 1.1 x a full generation's with bitwise-equal tensors; for the
fully trainable job, our async save's CPU per GiB <= 1.3 x the floor (one copy plus one BLAKE3
pass over the same bytes, ``compare.floor_series``, measured in the same run). Whether the fully
trainable job is within noise of earlier runs is read off against docs/performance.md.
"""

from __future__ import annotations

import statistics
from typing import Any

from . import jobs
from .compare_methods import (
    ASYNC,
    DCP_ASYNC,
    DCP_STAGED,
    DCP_SYNC,
    ORDER,
    OUR_EAGER,
    OUR_FULL,
    OUR_LAZY,
    OUR_SYNC,
)

GiB, MiB = 1 << 30, 1 << 20
BLOCK, LOST, CPU = "save() blocking (s)", "training time lost per checkpoint (s)", \
    "CPU user + system per GiB saved (s)"
CPU_SYS, E2E, SYNC = "  of which system (s)", "save() -> durable (s)", "synchronous save (s)"
RESTORE, RESHARD = "restore, 2 ranks (s)", "restore, 2 -> 3 ranks (s)"
CPU_SAVE = "CPU user + system per save (s)"
WRITTEN, WRITTEN_FIRST = "bytes written per generation, 2nd+ (MiB)", "bytes written, 1st generation (MiB)"
MIRROR, MIRROR_FIRST = "mirror bytes uploaded per gen, 2nd+ (MiB)", "mirror bytes uploaded, 1st gen (MiB)"
SHORT = {OUR_EAGER: "ours eager", OUR_FULL: "ours full", OUR_LAZY: "ours lazy", OUR_SYNC: "ours sync",
         DCP_SYNC: "DCP save", DCP_ASYNC: "DCP async", DCP_STAGED: "DCP staged"}
# the fine-tuning job's columns, spelled out in its header
FINETUNE_LONG = {OUR_EAGER: "dist_ckpt async eager, incremental generations (the default)",
                 OUR_FULL: "dist_ckpt async eager, incremental=False (every generation in full)",
                 DCP_ASYNC: "raw DCP async_save"}
MIRROR_MODES = {"incremental": OUR_EAGER, "full": OUR_FULL}  # mirror.MODES -> column

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


def cpu_per_save(rank: dict[str, Any], name: str) -> list[float]:
    """CPU seconds (user + system) of each standalone save and its completion."""
    series = rank["saves"][name]
    return [user + system for user, system in zip(series["cpu_user"], series["cpu_sys"], strict=True)]


def restore_cells(results: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Restore times by column (``restore_columns`` maps each measured restore to its column)."""
    columns: dict[str, str] = results[0].get("restore_columns") or \
        {"verified": OUR_SYNC, "dcp_load": DCP_SYNC}
    return {column: slowest(results, lambda r, k=key: r["restore"][k]) for key, column in columns.items()}


Series = dict[str, list[float]]


def mirror_cells(mirror: dict[str, Any] | None, written: Series,
                 written_first: Series) -> tuple[Series, Series]:
    """Mirror MiB uploaded per generation (rank 0's bucket count): after the first, and the
    first, per column; a mode whose uploads did not all complete has no cell. Raw DCP's would
    be its bytes written."""
    later: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    for mode, column in MIRROR_MODES.items():
        result = (mirror or {}).get(mode)
        if result and result["uploaded"] and all(result["completed"]):
            mib = [b / MiB for b in result["uploaded"]]
            first[column], later[column] = mib[:1], mib[1:]
    if mirror and DCP_ASYNC in written:
        later[DCP_ASYNC], first[DCP_ASYNC] = written[DCP_ASYNC], written_first.get(DCP_ASYNC, [])
    return later, first


def order_balanced(lost: list[float]) -> list[float]:
    """The time lost of consecutive pairs averaged two by two. Pairs alternate which run comes
    first (``compare.measure_saves``), and on a busy machine the first run of a pair is often
    slower by tenths of a second, one way in one session and the other way in the next: raw
    pairs then fall in two clusters whose median lands anywhere in the gap. Each average holds
    one pair of either order; an unmatched last pair is left out."""
    return [(lost[k] + lost[k + 1]) / 2 for k in range(0, len(lost) - 1, 2)]


def cells(ranks: list[dict[str, Any]], reshard: list[dict[str, Any]]) -> Cells:
    """Every measured cell; restore rows sit in the columns ``restore_columns`` names (full job:
    verified restore() under dist_ckpt sync, dcp.load under DCP save), the synchronous save row
    in the sync columns only, the mirror rows (fine-tuning job) in ours eager / full / DCP async."""
    out: Cells = {BLOCK: {}, LOST: {}, CPU: {}, CPU_SYS: {}, CPU_SAVE: {}, E2E: {}, SYNC: {}, RESTORE: {},
                  RESHARD: {}, WRITTEN: {}, WRITTEN_FIRST: {}, MIRROR: {}, MIRROR_FIRST: {}}
    for name in ranks[0]["methods"]:
        out[BLOCK][name] = slowest(ranks, lambda r, n=name: r["saves"][n]["block"])
        out[LOST][name] = order_balanced(slowest(ranks, lambda r, n=name: r["saves"][n]["lost"]))
        out[CPU][name] = slowest(ranks, lambda r, n=name: cpu_per_gib(r, n))
        out[CPU_SYS][name] = slowest(ranks, lambda r, n=name: cpu_per_gib(r, n, user_share=0.0))
        out[CPU_SAVE][name] = slowest(ranks, lambda r, n=name: cpu_per_save(r, n))
        out[E2E][name] = slowest(ranks, lambda r, n=name: r["saves"][n]["e2e"])
        out[WRITTEN][name] = slowest(ranks, lambda r, n=name: [b / MiB for b in r["saves"][n]["written"]])
        if ranks[0]["saves"][name].get("first_written"):
            out[WRITTEN_FIRST][name] = slowest(
                ranks, lambda r, n=name: [b / MiB for b in r["saves"][n]["first_written"]])
        if name not in ASYNC:
            out[SYNC][name] = out[E2E][name]
    for row, results in ((RESTORE, ranks), (RESHARD, reshard)):
        if results:
            out[row].update(restore_cells(results))
    out[MIRROR], out[MIRROR_FIRST] = mirror_cells(ranks[0].get("mirror"), out[WRITTEN], out[WRITTEN_FIRST])
    return {row: by for row, by in out.items() if by}


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


Spec = tuple[str, tuple[str, str], tuple[str, str] | None, float]
TRAINABLE = ("reference", "trainable_ref_mib")  # denominators read from the info
FLOOR = ("reference", "floor_s_per_gib")
BYTES_TARGET, MIRROR_TARGET = "bytes written per gen (2nd+) / trainable state", \
    "mirror bytes per gen (2nd+) / trainable state"
RESTORE_TARGET = "restore, incremental / full generation"


def issue28_specs(job: str) -> list[Spec]:
    """Issue 28's targets for ``job`` (``finetune`` or ``full``), judged ``value <= target x
    reference`` as the others."""
    if job != "finetune":
        return [("CPU per GiB, eager / floor (copy + BLAKE3)", (CPU, OUR_EAGER), FLOOR, 1.3)]
    return [
        (BYTES_TARGET, (WRITTEN, OUR_EAGER), TRAINABLE, 1.05),
        ("save() blocking, incremental / full save", (BLOCK, OUR_EAGER), (BLOCK, OUR_FULL), 0.1),
        ("save CPU, incremental / full save", (CPU_SAVE, OUR_EAGER), (CPU_SAVE, OUR_FULL), 0.1),
        ("time to durable, incremental / DCP async_save", (E2E, OUR_EAGER), (E2E, DCP_ASYNC), 0.1),
        (MIRROR_TARGET, (MIRROR, OUR_EAGER), TRAINABLE, 1.05),
        (RESTORE_TARGET, (RESTORE, OUR_EAGER), (RESTORE, OUR_FULL), 1.1),
    ]


def ratios(table: Cells, copy_s: float | None, specs: list[Spec] | None = None,
           references: dict[str, float | None] | None = None) -> dict[str, dict[str, Any]]:
    """Each target of ``specs`` (default ``target_specs()``): the value (ratio, or seconds for an
    absolute bound), the target and the verdict; a target whose method was not measured (no
    lazy snapshot) is None. A denominator ``("copy", ...)`` is ``copy_s``, ``("reference",
    key)`` is ``references[key]``. The verdict compares ``numerator <= target x denominator``,
    so a denominator of 0 or less still judges."""
    out: dict[str, dict[str, Any]] = {}
    for name, (row, method), denominator, target in (target_specs() if specs is None else specs):
        top = median_of(table, row, method)
        if denominator is None:
            bottom: float | None = 1.0
        elif denominator[0] == "copy":
            bottom = copy_s
        elif denominator[0] == "reference":
            bottom = (references or {}).get(denominator[1])
        else:
            bottom = median_of(table, *denominator)
        if top is None or bottom is None:
            out[name] = {"value": None, "op": "<=", "target": target, "pass": None}
            continue
        value = top / bottom if bottom > 0 else None
        out[name] = {"value": value, "op": "<=", "target": target, "pass": top <= target * bottom,
                     "numerator": top, "denominator": None if denominator is None else bottom}
    return out


def issue28_targets(table: Cells, info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 28's targets for the run's job, with what a figure alone cannot say: the restore
    target also needs bitwise-equal tensors, and a mirror upload that failed (no cell) fails
    its target with the reason."""
    references = {"trainable_ref_mib": info.get("trainable_ref_bytes", 0) / MiB or None,
                  "floor_s_per_gib": info.get("floor_s_per_gib")}
    out = ratios(table, info.get("copy_s"), issue28_specs(info.get("job", "full")), references)
    if RESTORE_TARGET in out:
        bitwise = info.get("bitwise", {})
        equal = bool(bitwise) and bitwise.get(OUR_EAGER) is True and bitwise.get(OUR_FULL) is True
        item = out[RESTORE_TARGET]
        item["bitwise"] = equal
        if item["pass"] is not None:
            item["pass"] = item["pass"] and equal
        if not equal:
            item["note"] = f"tensors not bitwise equal after restore: {bitwise}"
    if MIRROR_TARGET in out and out[MIRROR_TARGET]["value"] is None:
        failures = info.get("mirror_failures") or {}
        if failures.get("incremental"):
            out[MIRROR_TARGET]["pass"] = False
            out[MIRROR_TARGET]["note"] = f"mirror upload failed: {failures['incremental']}"
        elif not info.get("mirror_ran"):
            out[MIRROR_TARGET]["note"] = "no mirror run (--no-mirror, or moto_server not installed)"
    return out


def cell_text(table: Cells, row: str, name: str) -> str:
    value = median_of(table, row, name)
    return "" if value is None else f"{value:.3f}"


def print_compare(table: Cells, ratio_values: dict[str, dict[str, Any]], info: dict[str, Any],
                  issue28: dict[str, dict[str, Any]] | None = None) -> None:
    names = [name for name in ORDER if name in info["methods"]]
    finetune = info.get("job") == "finetune"
    job = ("fine-tuning: frozen base of that size, trainable adapters + AdamW "
           f"{info['trainable_global_bytes'] / MiB:.1f} MiB in all"
           if finetune else "model + AdamW state")
    print(f"\ncompare: {info['state_mib']} MiB per rank ({job}), 2 gloo ranks, "
          f"{'DDP' if info.get('kind') == 'ddp' else 'FSDP2'}, {info['repeats']} "
          f"repetitions, time lost over {info['steps']} train steps (idle {info['steps_s']:.3f} s) in "
          f"{info['lost_pairs']} pairs; "
          f"medians of the slowest rank; restores {info.get('restore_cache', 'warm')} ("
          + ("files dropped from the page cache before each" if info.get("restore_cache") == "cold"
             else "page cache kept for both") + ")")
    if OUR_LAZY not in names and not finetune:
        print("  (no dist_ckpt lazy column: CheckpointConfig has no `snapshot` field yet)")
    long = FINETUNE_LONG if finetune else {}
    print(f"  columns: {'; '.join(f'{SHORT[n]} = {long.get(n, n)}' for n in names)}")
    if finetune:
        print(f"  trainable state {info['trainable_ref_bytes'] / MiB:.2f} MiB = tensors (adapters + AdamW, "
              f"replicated ones once) {info['trainable_global_bytes'] / MiB:.2f} MiB + small state "
              f"(the incremental generation's files other than tensor data) "
              f"{info['small_state_bytes'] / 1024:.1f} KiB; bytes written per generation after the "
              f"first ({info['repeats']} standalone saves); restores each after an in-place change of "
              f"every tensor, checked bitwise")
    print(f"\n{'per checkpoint':42s}" + "".join(f"{SHORT[n]:>12s}" for n in names))
    for row in table:
        print(f"{row:42s}" + "".join(f"{cell_text(table, row, n):>12s}" for n in names))
    if info.get("copy_s") is not None:
        print(f"{'plain copy into preallocated buffers (s)':42s}{info['copy_s']:12.3f}")
    if info.get("floor_s_per_gib") is not None:
        print(f"{'CPU floor per GiB: copy + BLAKE3 (s)':42s}{info['floor_s_per_gib']:12.3f}"
              f"   (copy {info['floor_copy_s_per_gib']:.3f} + BLAKE3 {info['floor_hash_s_per_gib']:.3f}; "
              "one thread's CPU over the rank's tensors, slowest rank)")
    if info.get("bitwise"):
        print("restored tensors bitwise equal to the saved ones: " + "; ".join(
            f"{SHORT[n]} {'yes' if ok else 'NO'}" for n, ok in info["bitwise"].items()))
    for mode, failure in (info.get("mirror_failures") or {}).items():
        if failure:
            print(f"mirror upload ({mode}) failed: {failure}")
    print(f"noise: the {info['steps']} train steps without a save took {info['steps_min_s']:.3f} to "
          f"{info['steps_max_s']:.3f} s (median {info['steps_s']:.3f} s); allocator: {info['allocator']}")
    print(f"time lost over {info['lost_pairs']} pairs (averaged two by two, one of either order), "
          "first to third quartile (s): " + "; ".join(
        f"{SHORT[n]} {low:.3f} to {high:.3f}" for n in names
        for low, high in [info["lost_quartiles"][n]]))
    if not finetune:
        print_targets("compare target", ratio_values, {True: "PASS", False: "MISS", None: "n/a"})
    if issue28:
        print_targets("issue 28 target", issue28, {True: "met", False: "not met", None: "n/a"})


def print_targets(title: str, values: dict[str, dict[str, Any]], words: dict[bool | None, str]) -> None:
    print(f"\n{title:50s} {'ours':>8s} {'ref':>8s} {'value':>8s} {'target':>9s}  result")
    for name, item in values.items():
        value = "n/a" if item["value"] is None else f"{item['value']:.3f}"
        ours = "" if item.get("numerator") is None else f"{item['numerator']:.3f}"
        ref = "" if item.get("denominator") is None else f"{item['denominator']:.3f}"
        note = f"  ({item['note']})" if item.get("note") else ""
        print(f"{name:50s} {ours:>8s} {ref:>8s} {value:>8s} {'<=':>3s} {item['target']:5.2f}  "
              f"{words[item['pass']]}{note}")


Targets = dict[str, dict[str, Any]]


def floor_per_gib(ranks: list[dict[str, Any]], key: str | None = None) -> float | None:
    """Median over the repetitions of the slowest rank's floor CPU seconds per GiB of its state
    (``key``: ``copy_cpu`` or ``hash_cpu`` alone; None: both)."""
    if "floor" not in ranks[0]:
        return None
    keys = (key,) if key else ("copy_cpu", "hash_cpu")

    def per_gib(r: dict[str, Any]) -> list[float]:
        gib = r["state_bytes"] / GiB
        return [sum(values) / gib for values in zip(*(r["floor"][k] for k in keys), strict=True)]

    return statistics.median(slowest(ranks, per_gib))


def analyse(raw: dict[str, Any], cfg: dict[str, Any]
            ) -> tuple[Cells, Targets, dict[str, Any], Targets]:
    """The table, the compare targets, the header facts and issue 28's targets of a run."""
    ranks, reshard = raw["ranks"], raw["reshard"]
    table = cells(ranks, reshard)
    copy = slowest(ranks, lambda r: r["copy"])
    without = slowest(ranks, lambda r: [v for n in r["methods"] for v in r["saves"][n]["steps_without"]])
    first = ranks[0]
    bitwise: dict[str, bool] = {}
    for r in ranks:
        for name, ok in (r["restore"].get("bitwise") or {}).items():
            bitwise[name] = bitwise.get(name, True) and bool(ok)
    mirror = first.get("mirror") or {}
    info = {"state_mib": cfg["state_mib"], "repeats": cfg["repeats"], "steps": cfg["steps"],
            "methods": first["methods"], "copy_s": statistics.median(copy),
            "steps_s": statistics.median(without), "steps_min_s": min(without),
            "steps_max_s": max(without), "lazy": first["lazy"],
            "lost_pairs": len(first["saves"][first["methods"][0]]["lost"]),
            "lost_quartiles": {name: quartiles(values) for name, values in table[LOST].items()},
            "allocator": cfg.get("allocator", "glibc default"),
            "restore_cache": cfg.get("restore_cache", "warm"),
            "state_bytes": first["state_bytes"], "generation": first["generation"],
            "job": cfg.get("job", "full"), "kind": cfg.get("kind", "fsdp"),
            "trainable_bytes": sum(r["trainable_bytes"] for r in ranks),
            "trainable_global_bytes": first.get("trainable_global_bytes", 0),
            "small_state_bytes": first.get("small_state_bytes", 0),
            "floor_s_per_gib": floor_per_gib(ranks),
            "floor_copy_s_per_gib": floor_per_gib(ranks, "copy_cpu"),
            "floor_hash_s_per_gib": floor_per_gib(ranks, "hash_cpu"),
            "bitwise": bitwise, "mirror_ran": bool(mirror),
            "mirror_failures": {mode: result.get("failure") for mode, result in mirror.items()}}
    info["trainable_ref_bytes"] = info["trainable_global_bytes"] + info["small_state_bytes"]
    return table, ratios(table, info["copy_s"]), info, issue28_targets(table, info)


def document(raw: dict[str, Any], table: Cells, ratio_values: dict[str, dict[str, Any]],
             info: dict[str, Any], issue28: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``compare`` section of the JSON document."""
    return {
        "info": info, "issue28_targets": issue28 or {},
        "table": {row: {name: {**jobs.summary(values), "values": values} for name, values in by.items()}
                  for row, by in table.items()},
        "targets": ratio_values,
        "per_rank": raw["ranks"], "reshard": raw["reshard"],
        "profile_cpu": raw["ranks"][0].get("profile_cpu"),
    }
