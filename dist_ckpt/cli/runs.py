"""``dist-ckpt runs ROOT``: the launcher's runs under ROOT, each start's outcome and the per-rank
figures of its progress (own time per update, updates seen, straggler), from ``launch-log.jsonl``.

Starts are numbered in order within their run (``#``), across relaunches; ``start`` is the
launcher's own number, which begins at 1 with each launch. ROOT is the launcher's
``--checkpoint-root``, or a run's checkpoint root under it (the log is
looked for where ``dist-ckpt plan`` looks: ROOT, then ROOT/../..). Read only.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import StorageError
from ..launcher_api import LAUNCH_LOG_NAME, RUNS_COMMAND, launch_log_dirs
from ..storage.base import open_store
from .common import UsageError, print_table


def read_launch_log(root: str) -> tuple[str, list[dict[str, Any]]]:
    """(where the log was found, its records in order); a line that is not a JSON object is skipped
    (a launcher killed mid-append leaves at most one)."""
    for directory in launch_log_dirs(root):
        try:
            raw = open_store(directory).read_bytes(LAUNCH_LOG_NAME)
        except (StorageError, OSError, ValueError):  # absent or unreadable: try the next place
            continue
        found = []
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                found.append(record)
        return f"{directory.rstrip('/')}/{LAUNCH_LOG_NAME}", found
    raise UsageError(f"no {LAUNCH_LOG_NAME} under {root} (runs are recorded by python -m launch)")


def by_run(records: list[dict[str, Any]], only: str | None) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        run_id = str(record.get("run_id", "?"))
        if only is None or run_id == only:
            runs.setdefault(run_id, []).append(record)
    return runs


# why a rank has no figure: the launcher measures a rank's own time per update only once it
# saw a few intervals between its progress marks (launch/watchdog.py, MIN_INTERVALS)
NO_FIGURE = "no figure (too few updates seen to measure)"


def rank_figures(ranks: dict[str, dict[str, Any]]) -> str:
    parts = []
    for rank, figures in sorted(ranks.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1):
        median = figures.get("median_s_per_update")
        pace = NO_FIGURE if median is None else f"median {median:.3g} s/update"
        flag = ", straggler" if figures.get("straggler") else ""
        parts.append(f"rank {rank} {pace} over {figures.get('updates_seen', 0)} updates{flag}")
    return "; ".join(parts)


def start_row(number: int, record: dict[str, Any]) -> list[str]:
    """``number``: the start's place in its run, across relaunches (the launcher's own start
    number begins at 1 again with each launch)."""
    updates = record.get("updates")
    world = record.get("world_size")
    return [f"  {number}", str(record.get("start", "?")), "?" if world is None else str(world),
            str(record.get("classification", "?")),
            f"{float(record.get('duration_s') or 0):.1f}", "-" if updates is None else str(updates),
            str(record.get("resumed_from") or "?") + rejected_note(record), str(record.get("reason", ""))]


def rejected_note(record: dict[str, Any]) -> str:
    """`` (2 rejected: gen-10, gen-9)`` after where a start resumed, when its restore rejected any."""
    rejected = [str(r).split(" ", 1)[0].rstrip(":") for r in record.get("rejected") or []]
    return f" ({len(rejected)} rejected: {', '.join(rejected[:4])}{', ...' if len(rejected) > 4 else ''})" \
        if rejected else ""


def cmd_runs(args: argparse.Namespace) -> int:
    where, records = read_launch_log(args.root)
    runs = by_run(records, args.run)
    if args.run is not None and not runs:
        raise UsageError(f"no run {args.run!r} in {where}")
    if args.json:
        print(json.dumps({"log": where, "by_run": runs}, indent=2, sort_keys=True))
        return 0
    print(f"{where}: {len(runs)} run(s)")
    for run_id, starts in runs.items():
        print(f"run {run_id}: {len(starts)} start(s)")
        print_table([["  #", "start", "world", "outcome", "seconds", "updates", "resumed from", "why"],
                     *(start_row(number, record) for number, record in enumerate(starts, 1))])
        for number, record in enumerate(starts, 1):
            if record.get("ranks"):
                print(f"  #{number}, start {record.get('start', '?')} ranks: {rank_figures(record['ranks'])}")
    return 0


def add_runs_parser(sub: Any) -> argparse.ArgumentParser:
    runs = sub.add_parser(RUNS_COMMAND, help="the launcher's runs: each start's outcome and per-rank figures",
                          description=__doc__.splitlines()[0].replace("``", ""))
    runs.set_defaults(func=cmd_runs)
    runs.add_argument("root", metavar="ROOT",
                      help="the launcher's --checkpoint-root (or a run's root under it)")
    runs.add_argument("--run", default=None, metavar="ID", help="only this run")
    return runs
