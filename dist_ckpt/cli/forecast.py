"""``dist-ckpt plan``, a forecast: how often to save (T* = sqrt(2 C M)), the time lost, the disk
needed and per-tier figures, from recorded save costs and the launcher's step times (the
estimate itself is ``costs.py``; the model ``save/cadence.py``). The command keeps its public
name; inside the code "plan" is DCP's save plan only, so this module says "forecast"."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from typing import Any

from ..errors import StorageError
from ..format.inventory import inventory
from ..format.manifest import Manifest
from ..format.signing import key_from_env
from ..launcher_api import LAUNCH_LOG_NAME, RUNS_DIR, launch_log_dirs
from ..storage.base import Store, open_store
from .common import UsageError, human_bytes, open_root
from .costs import (
    CostEstimate,
    PriceEstimate,
    StoragePrice,
    estimate_costs,
    median_save_cost,
    parse_duration,
    parse_storage_prices,
    step_time_from_log,
)

FORECAST_EPILOG = f"""\
defaults and where they come from:
  --save-cost   median save_duration_s of the committed generations' manifests under ROOT
  --step-time   sum(duration_s) / sum(updates) of {LAUNCH_LOG_NAME} in ROOT or ROOT/../..
                (the launcher keeps runs at LAUNCHROOT/{RUNS_DIR}/<id>/, its log at LAUNCHROOT)
  generation    total_bytes of the newest committed generation (--generation-bytes overrides)

durations take a unit: 500ms, 0.8s, 5m, 4h, 30d (no unit: seconds).

""" + """\
--tiers FILE is a JSON file of per-tier rates (no prices are built in; they change):
  {"tiers": [
    {"name": "local NVMe", "read_bytes_per_s": 2e9},
    {"name": "S3 standard", "read_bytes_per_s": 5e8, "usd_per_gb_month": 0.023,
     "usd_per_1000_put": 0.005, "usd_per_1000_get": 0.0004}
  ]}
name and read_bytes_per_s (restore bandwidth) are required, each price is optional and costs
are shown only for the prices given. GB = 2**30 bytes, a month = 365.25/12 days.
"""


def duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:  # ArgumentTypeError keeps our message (exit 2 via argparse)
        raise argparse.ArgumentTypeError(str(exc)) from exc


def byte_count_arg(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"invalid byte count {text!r}: expected e.g. 2e10 or 20000000000")
    return int(value)


def save_cost_input(given: float | None, committed: list[Manifest], root: str) -> tuple[float, str]:
    if given is not None:
        return given, "--save-cost"
    found = median_save_cost(m.save_duration_s for m in committed)
    if found is None:
        raise UsageError(f"no committed generation under {root} records a save duration; "
                         "pass --save-cost (e.g. --save-cost 30s)")
    return found[0], f"median of {found[1]} recorded saves"


def step_time_input(given: float | None, root: str) -> tuple[float | None, str]:
    if given is not None:
        return given, "--step-time"
    for directory in launch_log_dirs(root):
        try:
            raw = open_store(directory).read_bytes(LAUNCH_LOG_NAME)
        except (StorageError, OSError, ValueError):  # absent or unreadable: try the next place
            continue
        found = step_time_from_log(raw.decode("utf-8", errors="replace"))
        if found is not None:
            return found.step_time_s, (f"{directory.rstrip('/')}/{LAUNCH_LOG_NAME}: {found.duration_s:.0f} s "
                                       f"over {found.updates} updates in {found.launches} launch(es)")
    return None, (f"unknown: pass --step-time (or launch with the launcher, whose {LAUNCH_LOG_NAME} "
                  "records it)")


def generation_input(given_bytes: int | None, newest: Manifest | None) -> tuple[int | None, str]:
    if given_bytes is not None:
        return given_bytes, "--generation-bytes"
    if newest is None:
        return None, "unknown: no committed generation; pass --generation-bytes"
    return newest.total_bytes, f"newest committed generation {newest.generation}"


def shared_bytes_input(given_bytes: int | None, newest: Manifest | None) -> int:
    """The newest generation's shared objects (stored once however many generations are kept);
    none when the size is given on the command line."""
    if given_bytes is not None or newest is None:
        return 0
    return sum(entry.size for entry in newest.objects)


def read_tiers_file(path: str | None) -> list[StoragePrice]:
    if path is None:
        return []
    try:
        with open(path, "rb") as handle:
            return parse_storage_prices(handle.read())
    except OSError as exc:
        raise UsageError(f"cannot read tiers file {path!r}: {exc}") from exc
    except ValueError as exc:
        raise UsageError(f"tiers file {path!r} is malformed: {exc}") from exc


def build_estimate(args: argparse.Namespace, backend: Store) -> CostEstimate:
    committed = sorted((i.manifest for i in inventory(backend, digests=False, key=key_from_env())
                        if i.state == "committed" and i.manifest),
                       key=lambda manifest: manifest.next_update, reverse=True)
    newest = committed[0] if committed else None
    save_cost, save_cost_src = save_cost_input(args.save_cost, committed, backend.root)
    step_time, step_time_src = step_time_input(args.step_time, args.root)
    size, size_src = generation_input(args.generation_bytes, newest)
    sources = {
        "save_cost_s": save_cost_src, "step_time_s": step_time_src, "generation_bytes": size_src,
        "mtbf_s": "--mtbf" if args.mtbf is not None else "default 4h",
        "run_length_s": "--run-length" if args.run_length is not None else "default 30d",
        "keep_last": "--keep-last" if args.keep_last is not None else
        "default: every generation of the run, as CheckpointConfig's keep_last=None deletes nothing",
        "files_per_generation": "unknown: no committed generation" if newest is None else
        f"newest committed generation {newest.generation}: {len(newest.files)} files + manifest"}
    def estimate(keep_last: int) -> CostEstimate:
        return estimate_costs(
            save_cost_s=save_cost, mtbf_s=args.mtbf or 4 * 3600.0,
            run_length_s=args.run_length or 30 * 86400.0, step_time_s=step_time,
            generation_bytes=size, files_per_generation=None if newest is None else len(newest.files) + 1,
            keep_last=keep_last, keep_every=args.keep_every,
            prices=read_tiers_file(args.tiers), sources=sources,
            shared_bytes=shared_bytes_input(args.generation_bytes, newest),
            shared_files=0 if newest is None else len(newest.objects))

    try:
        if args.keep_last is not None:
            return estimate(args.keep_last)
        # the library's default keeps every generation: as many as the run saves
        return estimate(max(1, math.ceil(estimate(1).saves)))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def human_seconds(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds:.1f} s ({seconds / size:.1f} {unit})"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.3g} s"


def head_lines(estimate: CostEstimate) -> list[str]:
    src = estimate.sources
    step = "-" if estimate.step_time_s is None else f"{estimate.step_time_s:.4g} s"
    updates = f" = {estimate.interval_updates} updates" if estimate.interval_updates is not None else \
        " (in updates: pass --step-time)"
    return [
        f"  save cost C      {human_seconds(estimate.save_cost_s)}  [{src['save_cost_s']}]",
        f"  MTBF M           {human_seconds(estimate.mtbf_s)}  [{src['mtbf_s']}]",
        f"  step time        {step}  [{src['step_time_s']}]",
        f"  run length       {human_seconds(estimate.run_length_s)}  [{src['run_length_s']}]",
        f"interval T* = sqrt(2 C M) = {human_seconds(estimate.interval_s)}{updates}",
        f"time lost at T*  {estimate.lost_fraction:.2%} (saving C/T* {estimate.lost_saving_fraction:.2%} "
        f"+ rework T*/2M {estimate.lost_rework_fraction:.2%})",
        f"over the run     {estimate.saves:.0f} saves, {estimate.restores:.1f} expected restores "
        "(run length / M)",
    ]


def milestone_line(estimate: CostEstimate) -> str:
    if estimate.keep_every is None:
        return "0 (no --keep-every)"
    if estimate.run_updates is None:
        return "0 counted: the run length in updates needs a step time (--step-time)"
    return (f"{estimate.milestones}: multiples of --keep-every {estimate.keep_every} within the run's "
            f"{estimate.run_updates} updates (assumes a save lands on each)")


def disk_lines(estimate: CostEstimate) -> list[str]:
    if estimate.generation_bytes is None or estimate.disk_bytes is None:
        return [f"disk needed      {estimate.sources['generation_bytes']}"]
    size, src = human_bytes(estimate.generation_bytes), estimate.sources
    total, kept = human_bytes(estimate.disk_bytes), estimate.keep_last
    generation = f"  generation     {size} = {estimate.generation_bytes} bytes [{src['generation_bytes']}]"
    if estimate.shared_bytes:
        own, shared = (human_bytes(estimate.generation_bytes - estimate.shared_bytes),
                       human_bytes(estimate.shared_bytes))
        head = (f"disk needed      {total} = ({kept} kept + {estimate.milestones} milestones + 1 staging) "
                f"x {own} own + {shared} shared objects once")
        generation += f", of which {shared} in shared objects (incremental: written once, referenced by each)"
        staging = "  staging        one more generation's own bytes: a save in flight"
    else:
        head = (f"disk needed      {total} = ({kept} kept + {estimate.milestones} milestones) x {size} "
                f"+ {size} staging")
        staging = "  staging        one more generation: a save in flight"
    return [head, f"  kept           {kept} newest generations (--keep-last) [{src['keep_last']}]",
            f"  milestones     {milestone_line(estimate)}", generation, staging]


def usd(amount: float) -> str:
    # cents would hide small per-tier costs, so three significant digits below $10
    if amount >= 10:
        return f"${amount:,.2f}"
    return f"${amount:.3g}" if amount >= 0.01 or amount == 0 else "<$0.01"


def price_lines(price: PriceEstimate, estimate: CostEstimate) -> list[str]:
    lines = [f"tier {price.name!r} (reads {human_bytes(int(price.read_bytes_per_s))}/s)"]
    if price.restore_s is not None and price.gb_months is not None:
        lines += [f"  restore one generation  {human_seconds(price.restore_s)}",
                  f"  stored                  {price.gb_months:.2f} GB-months "
                  f"(average {estimate.keep_last} kept + {estimate.milestones}/2 milestones)"]
    if price.put_requests is not None and price.get_requests is not None:
        files = estimate.files_per_generation
        lines += [f"  PUT requests            {price.put_requests:.0f} "
                  f"({estimate.saves:.0f} saves x {files} files)",
                  f"  GET requests            {price.get_requests:.0f} "
                  f"({estimate.restores:.1f} restores x {files} files)"]
    costs = [(label, value) for label, value in (("storage", price.storage_usd), ("PUT", price.put_usd),
                                                 ("GET", price.get_usd)) if value is not None]
    if costs and price.total_usd is not None:
        parts = " + ".join(f"{usd(value)} {label}" for label, value in costs)
        lines.append(f"  cost over the run       {parts} = {usd(price.total_usd)}")
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    estimate = build_estimate(args, backend)
    if args.json:
        print(json.dumps({"root": backend.root, **asdict(estimate)}, indent=1))
        return 0
    lines = [f"cadence plan for {backend.root}", *head_lines(estimate), *disk_lines(estimate)]
    for price in estimate.tiers:
        lines += price_lines(price, estimate)
    lines += [f"note: {note}" for note in estimate.notes]
    print("\n".join(lines))
    return 0


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser("plan", help="how often to save, the time lost, the disk and tier costs",
                            description="Young's checkpoint interval T* = sqrt(2 C M), the expected "
                            "time lost at T*,\nthe disk needed under ROOT and per-tier figures.",
                            epilog=FORECAST_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(func=cmd_plan)
    parser.add_argument("--mtbf", type=duration_arg, default=None, metavar="DUR",
                        help="mean time between failures of the job (default 4h)")
    parser.add_argument("--save-cost", type=duration_arg, default=None, metavar="DUR",
                        help="time training stalls per save, C (default: median recorded under ROOT)")
    parser.add_argument("--step-time", type=duration_arg, default=None, metavar="DUR",
                        help=f"seconds per update (default: from the launcher's {LAUNCH_LOG_NAME})")
    parser.add_argument("--run-length", type=duration_arg, default=None, metavar="DUR",
                        help="wall time of the whole run (default 30d)")
    parser.add_argument("--keep-last", type=int, default=None, metavar="K",
                        help="newest generations kept by pruning (default: every generation of the run, "
                             "as the library keeps them without keep_last)")
    parser.add_argument("--keep-every", type=int, default=None, metavar="N",
                        help="milestones kept: update numbers that are multiples of N")
    parser.add_argument("--generation-bytes", type=byte_count_arg, default=None, metavar="BYTES",
                        help="size of one generation (default: the newest committed one)")
    parser.add_argument("--tiers", default=None, metavar="FILE", help="JSON file of per-tier rates (below)")
    return parser
