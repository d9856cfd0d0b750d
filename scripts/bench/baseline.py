"""The compare phase against a stored baseline: a change that costs training time shows in the
run that follows it, not issues later.

A baseline is one compare run of a known commit on this machine, kept in the repository
(``scripts/bench/baselines/compare-<job>-<kind>-<MiB>.json``: the medians of the slowest rank
per row and column, the commit, the machine, the command). Every compare run looks for the
baseline of its own job, kind and size (or ``--baseline PATH``), prints each of today's
medians beside its ratio to the baseline's, and names every cell that got worse by more than
the run-to-run noise allows (``WORSE_RATIO`` and ``WORSE_ABS_S`` together: a small figure may
double by noise alone). A baseline of another machine is still printed, with a warning: ratios
between machines say little.

``--write-baseline PATH`` stores the run's medians as a new baseline; docs/performance.md names
the baseline's commit. Or, from a results file of an earlier run (e.g. one of another commit's
tree, the bench of this one)::

    .venv/bin/python -m scripts.bench.baseline bench-results.json --commit 3912524 --out PATH
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Any

from .compare_report import LOST, SHORT, Cells, quartiles

BASELINE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines")
WORSE_RATIO = 1.2  # a median above 1.2 x the baseline's ...
WORSE_ABS_S = 0.05  # ... and more than this above it in absolute terms, is named as worse
# rows whose unit is not seconds: the absolute slack does not apply
UNITLESS_ROWS = ("MiB",)


def default_path(cfg: dict[str, Any]) -> str:
    return os.path.join(BASELINE_DIR, f"compare-{cfg.get('job', 'full')}-{cfg.get('kind', 'fsdp')}-"
                                      f"{cfg['state_mib']}.json")


def medians(table: Cells) -> dict[str, dict[str, float]]:
    return {row: {name: statistics.median(values) for name, values in by.items() if values}
            for row, by in table.items()}


def spreads(table: Cells) -> dict[str, dict[str, list[float]]]:
    """First and third quartile of every cell: a cell is worse than the baseline's only when
    the middle halves of the two runs do not overlap (the time-lost row is a small
    difference of two long runs, its spread larger than a real regression of 0.1 s)."""
    return {row: {name: list(quartiles(values)) for name, values in by.items() if values}
            for row, by in table.items()}


def head_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(BASELINE_DIR)).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def record(table: Cells, cfg: dict[str, Any], *, commit: str | None, machine: str,
           command: str) -> dict[str, Any]:
    return {"commit": commit, "measured": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine,
            "command": command, "state_mib": cfg["state_mib"], "job": cfg.get("job", "full"),
            "kind": cfg.get("kind", "fsdp"), "steps": cfg.get("steps"), "medians": medians(table),
            "quartiles": spreads(table)}


def write(path: str, baseline: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(baseline, handle, indent=1, sort_keys=True)
        handle.write("\n")


def load(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) and isinstance(loaded.get("medians"), dict) else None


def worse(row: str, today: float, then: float, today_q1: float | None = None,
          then_q3: float | None = None) -> bool:
    """Whether ``today`` is worse than the baseline's ``then`` by more than noise (lower is
    better in every row of the compare table): above ``WORSE_RATIO`` x and ``WORSE_ABS_S``
    more, and, where both runs' spreads are known, today's first quartile above the
    baseline's third."""
    slack = 0.0 if any(unit in row for unit in UNITLESS_ROWS) else WORSE_ABS_S
    beyond = today > WORSE_RATIO * then + slack if then > 0 else today > then + slack
    return beyond and (today_q1 is None or then_q3 is None or today_q1 > then_q3)


Cell = tuple[str, str, float, float, float | None, bool]


def compare(table: Cells, baseline: dict[str, Any]) -> list[Cell]:
    """(row, method, today, baseline, ratio or None, worse) for every cell both runs measured."""
    out = []
    then_by_row, then_spread = baseline["medians"], baseline.get("quartiles") or {}
    today_spread = spreads(table)
    for row, by in medians(table).items():
        for name, today in by.items():
            then = then_by_row.get(row, {}).get(name)
            if then is None:
                continue
            then_q3 = (then_spread.get(row, {}).get(name) or [None, None])[1]
            is_worse = worse(row, today, then, today_spread[row][name][0], then_q3)
            out.append((row, name, today, then, today / then if then > 0 else None, is_worse))
    return out


def print_against(table: Cells, names: list[str], baseline: dict[str, Any] | None, path: str,
                  machine: str) -> list[str]:
    """Print today's medians with their ratio to ``baseline``; returns the worse cells' lines."""
    if baseline is None:
        print(f"\nno baseline at {path}: nothing to compare with (--write-baseline stores this run's)")
        return []
    print(f"\nagainst the baseline of {baseline.get('commit') or '?'} ({baseline.get('measured', '?')}; "
          f"{path}): today's median, then x its ratio to the baseline's")
    if baseline.get("machine") != machine:
        print(f"  warning: the baseline was measured on another machine ({baseline.get('machine')}); "
              "its ratios say little")
    cells = {(row, name): rest for row, name, *rest in compare(table, baseline)}
    print(f"{'per checkpoint':42s}" + "".join(f"{SHORT[n]:>18s}" for n in names))
    flagged = []
    for row in table:
        line = f"{row:42s}"
        for name in names:
            if (row, name) not in cells:
                line += f"{'':>18s}"
                continue
            today, then, ratio, is_worse = cells[(row, name)]
            text = f"{today:.3f} x{ratio:.2f}" if ratio is not None else f"{today:.3f} (b {then:.3f})"
            if is_worse:
                text += "!"
                flagged.append(f"{row.strip()}, {SHORT[name]}: {today:.3f} against {then:.3f} "
                               f"at {baseline.get('commit')}")
            line += f"{text:>18s}"
        print(line)
    # ours only: raw DCP's figures move with the page cache's writeback, not with this code
    lost = [f for f in flagged if f.startswith(LOST.strip()) and ", ours " in f]
    print(f"worse than the baseline beyond noise (> {WORSE_RATIO} x, > {WORSE_ABS_S} s more, middle "
          "halves apart): " + ("; ".join(flagged) if flagged else "none"))
    if lost:
        print("  TRAINING TIME LOST REGRESSED: find the cause before this change lands")
    return flagged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.baseline",
                                     description="store a compare run's medians as a baseline")
    parser.add_argument("results", help="a bench-results.json with a compare section")
    parser.add_argument("--commit", required=True, help="the commit the run measured")
    parser.add_argument("--out", default=None, help="where to write (default: the run's default path)")
    args = parser.parse_args(argv)
    with open(args.results, encoding="utf-8") as handle:
        doc = json.load(handle)
    compare_doc, cfg = doc["compare"], doc["config"]
    table = {row: {name: cell["values"] for name, cell in by.items()}
             for row, by in compare_doc["table"].items()}
    out = args.out or default_path(cfg)
    write(out, record(table, cfg, commit=args.commit, machine=doc.get("machine", ""),
                      command=doc.get("command", "")))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
