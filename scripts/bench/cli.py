"""Command line: parse the options, run everything, print the table, write the JSON."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

from . import jobs, report
from .runner import run_all

USAGE = """The dist_ckpt benchmark: every performance target measured in one run (2 gloo ranks).

Usage: .venv/bin/python scripts/bench.py [--quick] [--state-mib N] [--repeats R] [--dir DIR]
                                         [--json bench-results.json] [--profile]
       (or: python -m scripts.bench ..., python scripts/bench ...)

Phases and targets: see the docstring of scripts/bench/__init__.py. Not a test.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB per rank, 3 repetitions")
    parser.add_argument("--state-mib", type=int, default=None, help="per-rank state (default 512)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 5, quick 3)")
    parser.add_argument("--dir", default=None, help="parent of the benchmark directory (default: temp)")
    parser.add_argument("--json", default="bench-results.json", help="where to write the results")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one extra rank-0 save()/restore()/commit and print the top entries")
    args = parser.parse_args(argv)
    args.state_mib = args.state_mib or (64 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 3 or (args.repeats < 5 and not args.quick):
        parser.error("--repeats must be >= 5 (>= 3 with --quick)")
    return args


def print_header(args: argparse.Namespace, raw: dict[str, Any], walls: dict[str, float]) -> None:
    saves = raw["main"][0]["saves"]
    print(f"\n{jobs.machine()}")
    local_mib = raw["main"][0]["state_bytes"] / jobs.MiB
    print(f"state {args.state_mib} MiB per rank ({local_mib:.0f} MiB local tensors), 2 gloo ranks, "
          f"{args.repeats} repetitions; generation {saves['generation_bytes'] / jobs.MiB:.0f} MiB in "
          f"{saves['generation_files']} files; wall {walls['total']:.0f} s")
    steps = raw["main"][0]["interference"]["steps_per_save"]
    print(f"interference: {len(steps)} async saves, train steps run while each was in flight: {steps}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = {"state_mib": args.state_mib, "repeats": args.repeats, "profile": args.profile}
    started = time.perf_counter()
    walls: dict[str, float] = {}
    base = tempfile.mkdtemp(prefix="bench-", dir=args.dir)
    try:
        raw = run_all(cfg, base, walls)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    walls["total"] = time.perf_counter() - started
    rows = report.timing_rows(raw["main"], raw["reshard"], raw["scale"])
    ratio_values = report.ratios(rows, raw["memory"])
    print_header(args, raw, walls)
    report.print_table(rows, ratio_values, raw["memory"])
    for name, text in raw["profiles"].items():
        print(f"\n---- cProfile: {name} ----\n{text}")
    with open(args.json, "w") as handle:
        json.dump(report.document(raw, cfg, walls, rows, ratio_values), handle, indent=1, default=str)
    print(f"\nwrote {args.json}")
