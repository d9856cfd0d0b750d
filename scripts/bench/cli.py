"""Command line: parse the options, run everything, print the table, write the JSON."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from typing import Any

from . import baseline, compare_report, jobs, report
from .compare_methods import ORDER
from .cpu_profile import format_profile
from .heartbeat import print_costs
from .runner import OPT_IN_PHASES, PHASES, run_all
from .scale_report import DEFAULT_RANKS
from .scale_report import print_table as print_scale_table

USAGE = """The dist_ckpt benchmark: every performance target measured in one run (2 gloo ranks).

Usage (from the repository root):
       .venv/bin/python -m scripts.bench [--quick] [--state-mib N] [--repeats R] [--dir DIR]
                                         [--json bench-results.json] [--profile]
                                         [--phases P,...] [--compare] [--steps N] [--lost-pairs N]
                                         [--allocator caching|glibc] [--profile-cpu]
                                         [--job full|finetune] [--kind fsdp|ddp] [--no-mirror]
                                         [--baseline PATH] [--write-baseline PATH]
                                         [--ranks W,...] [--ranks-per-node N] [--items T]

Phases (default: all): saves, restore (needs saves), interference, memory, commit_scale,
heartbeat (the cost of a progress call with nothing pending), compare (dist_ckpt side by side
with raw DCP save / async_save / async_save with async staging; with --job finetune: our
incremental save, our incremental=False save and raw DCP async_save, plus the mirror bytes
uploaded to a moto S3 server the run starts, and issue 28's targets). Run only when named:
scale (the save, idle and restore protocol of --ranks simulated ranks against one real
TCPStore server; scripts/bench/scale.py says what it does and does not simulate).

The compare phase also prints each median beside its ratio to the stored baseline of the same
job, kind and size (scripts/bench/baselines/; scripts/bench/baseline.py) and names every cell
worse than the baseline beyond noise.

Phases and targets: docs/performance.md. Not a test.
"""

SCALE_OPTIONS = (  # the scale phase's numbers: option, type, default, help
    ("--ranks-per-node", int, 8, "simulated ranks per node"),
    ("--items", int, 100, "state-dict items per rank"),
    ("--scale-saves", int, 2, "measured saves per world size"),
    ("--scale-warmup", int, 1, "saves before the measured ones"),
    ("--scale-workers", int, 3, "client processes for the ranks other than 0"),
    ("--scale-budget-s", float, 600.0, "wall-time budget per world size; a case over it is printed "
                                       "as 'not measured' with what it had done"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench", description=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB per rank, 3 repetitions")
    parser.add_argument("--state-mib", type=int, default=None, help="per-rank state (default 512)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 5, quick 3)")
    parser.add_argument("--dir", default=None, help="parent of the benchmark directory (default: temp)")
    parser.add_argument("--json", default="bench-results.json", help="where to write the results")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one extra rank-0 save()/restore()/commit and print the top entries")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated phases to run (default all: {','.join(PHASES)})")
    parser.add_argument("--compare", action="store_true", help="only the compare phase (--phases compare)")
    parser.add_argument("--steps", type=int, default=8,
                        help="compare: train steps over which the training time lost is measured")
    parser.add_argument("--lost-pairs", type=int, default=None,
                        help="compare: with / without pairs of step runs per method for the training "
                             "time lost (default: --repeats)")
    parser.add_argument("--allocator", choices=("caching", "glibc"), default="caching",
                        help="compare: 'caching' (default) starts the ranks with glibc keeping freed "
                             "memory (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_), as a caching "
                             "allocator would; 'glibc' leaves glibc's defaults")
    parser.add_argument("--job", choices=jobs.JOBS, default="full",
                        help="compare: 'full' (every parameter trained) or 'finetune' (a frozen base "
                             "of --state-mib per rank with trainable low-rank adapters)")
    parser.add_argument("--kind", choices=("fsdp", "ddp"), default="fsdp",
                        help="compare: FSDP2 (default) or DDP")
    parser.add_argument("--no-mirror", action="store_true",
                        help="compare, finetune job: leave out the mirror-bytes row (no moto S3 server)")
    parser.add_argument("--restore-cache", choices=("cold", "warm"), default="cold",
                        help="compare: restores with the generation's files dropped from the page cache "
                             "before each (cold, default: what a restarted job sees) or kept (warm)")
    parser.add_argument("--baseline", default=None,
                        help="compare: the stored baseline to print ratios against (default: "
                             "scripts/bench/baselines/compare-<job>-<kind>-<MiB>.json)")
    parser.add_argument("--write-baseline", default=None, metavar="PATH",
                        help="compare: store this run's medians as a baseline at PATH")
    parser.add_argument("--profile-cpu", action="store_true",
                        help="compare: per-thread CPU split (and py-spy stacks if installed) of one "
                             "dist_ckpt async save on rank 0")
    parser.add_argument("--ranks", default=",".join(str(w) for w in DEFAULT_RANKS),
                        help="scale: simulated world sizes, comma-separated (default %(default)s)")
    for name, kind, default, text in SCALE_OPTIONS:
        parser.add_argument(name, type=kind, default=default, help=f"scale: {text} (default {default:g})")
    parser.add_argument("--scale-node-local", action="store_true",
                        help="scale: each node holds its own copy of the root (node copies: every "
                             "other node's leader reads the manifest); default: one shared root")
    args = parser.parse_args(argv)
    args.phases = parse_phases(parser, "compare" if args.compare else args.phases)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.lost_pairs is not None and args.lost_pairs < 1:
        parser.error("--lost-pairs must be >= 1")
    try:
        args.ranks = [int(w) for w in args.ranks.split(",") if w.strip()]
    except ValueError:
        parser.error("--ranks: a comma-separated list of world sizes")
    if not args.ranks or min(args.ranks) < 2 or args.ranks_per_node < 1 or args.items < 1 \
            or args.scale_saves < 1 or args.scale_workers < 1 or args.scale_warmup < 0:
        parser.error("--ranks (each >= 2), --ranks-per-node, --items, --scale-saves and "
                     "--scale-workers must be positive")
    args.state_mib = args.state_mib or (64 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 3 or (args.repeats < 5 and not args.quick):
        parser.error("--repeats must be >= 5 (>= 3 with --quick)")
    return args


def parse_phases(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """The selected phases in run order; restore reads the generation the saves phase leaves."""
    wanted = {p.strip() for p in text.split(",") if p.strip()}
    known = PHASES + OPT_IN_PHASES
    unknown = wanted - set(known)
    if unknown or not wanted:
        parser.error(f"--phases: unknown {sorted(unknown)}; choose from {','.join(known)}")
    if "restore" in wanted:
        wanted.add("saves")
    return [p for p in known if p in wanted]


def print_header(args: argparse.Namespace, raw: dict[str, Any], walls: dict[str, float]) -> None:
    print(f"\n{jobs.machine()}")
    print(f"phases {','.join(args.phases)}; state {args.state_mib} MiB per rank, 2 gloo ranks, "
          f"{args.repeats} repetitions; wall {walls['total']:.0f} s")
    main = raw["main"][0] if raw["main"] else {}
    if "saves" in main:
        saves = main["saves"]
        print(f"{main['state_bytes'] / jobs.MiB:.0f} MiB local tensors per rank; generation "
              f"{saves['generation_bytes'] / jobs.MiB:.0f} MiB in {saves['generation_files']} files")
    if "interference" in main:
        steps = main["interference"]["steps_per_save"]
        print(f"interference: {len(steps)} async saves, train steps run while each was in flight: {steps}")


def against_baseline(args: argparse.Namespace, cfg: dict[str, Any], table: Any, info: dict[str, Any],
                     doc: dict[str, Any]) -> None:
    """The compare table beside the stored baseline's (``baseline.py``); ``--write-baseline``."""
    path = args.baseline or baseline.default_path(cfg)
    names = [name for name in ORDER if name in info["methods"]]
    doc["compare"]["worse_than_baseline"] = baseline.print_against(
        table, names, baseline.load(path), path, jobs.machine())
    if args.write_baseline:
        baseline.write(args.write_baseline, baseline.record(
            table, cfg, commit=baseline.head_commit(), machine=jobs.machine(), command=doc["command"]))
        print(f"wrote the baseline {args.write_baseline}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = {"state_mib": args.state_mib, "repeats": args.repeats, "profile": args.profile,
           "phases": args.phases, "steps": args.steps, "profile_cpu": args.profile_cpu,
           "lost_pairs": args.lost_pairs, "allocator": args.allocator, "job": args.job,
           "kind": args.kind, "mirror": not args.no_mirror, "restore_cache": args.restore_cache,
           "ranks": args.ranks, "ranks_per_node": args.ranks_per_node, "items": args.items,
           "scale_saves": args.scale_saves, "scale_warmup": args.scale_warmup,
           "scale_workers": args.scale_workers,
           "scale_budget_s": args.scale_budget_s, "scale_node_local": args.scale_node_local}
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
    report.print_saves_per_rank(raw["main"])
    for name, text in raw["profiles"].items():
        print(f"\n---- cProfile: {name} ----\n{text}")
    doc = report.document(raw, cfg, walls, rows, ratio_values)
    doc["command"] = "python -m scripts.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if "scale_cases" in raw:
        print_scale_table(raw["scale_cases"])
        doc["scale"] = raw["scale_cases"]
    if "heartbeat" in raw:
        print_costs(raw["heartbeat"])
        doc["heartbeat_us"] = raw["heartbeat"]
    if "compare" in raw:
        table, targets, info, issue28 = compare_report.analyse(raw["compare"], cfg)
        compare_report.print_compare(table, targets, info, issue28)
        doc["compare"] = compare_report.document(raw["compare"], table, targets, info, issue28)
        against_baseline(args, cfg, table, info, doc)
        if doc["compare"]["profile_cpu"]:
            print(f"\n---- CPU profile: one dist_ckpt async eager save, rank 0 ----\n"
                  f"{format_profile(doc['compare']['profile_cpu'])}")
    with open(args.json, "w") as handle:
        json.dump(doc, handle, indent=1, default=str)
    print(f"\nwrote {args.json}")
