"""``dist-ckpt`` command line: list, inspect, verify, pin and prune the generations under a root,
and plan the checkpoint cadence (``plan``).

Exit codes: 0 success; 1 a generation is invalid (or its manifest unreadable); 2 usage errors
(missing root, unsafe or unknown generation name, unsupported storage URL).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from .cadence import (
    Plan,
    Tier,
    TierPlan,
    make_plan,
    median_save_cost,
    parse_duration,
    parse_tiers,
    step_time_from_log,
)
from .errors import DistCkptError, StorageError, UnsafeNameError, ValidationError
from .inventory import GenerationInfo, inventory
from .manifest import LATEST_NAME, PENDING_PREFIX, LatestPointer, Manifest, check_generation_name
from .mirror import read_mirror_state
from .retention import prune, prune_object_store, read_pins, set_pin
from .signing import KEY_ENV, key_from_env
from .storage.base import Backend, is_remote, open_backend
from .storage.objectstore import ObjectStoreBackend
from .validate import list_generations, read_manifest, validate

PROG = "dist-ckpt"
LAUNCH_LOG = "launch-log.jsonl"
_PENDING_RE = re.compile(rf"^{re.escape(PENDING_PREFIX)}gen-(\d{{12}})(?:-|$)")


class UsageError(Exception):
    """A problem with the command line or the root; reported with exit status 2."""


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def open_root(root: str) -> Backend:
    """Open ``root`` and check it is a readable directory."""
    try:
        backend = open_backend(root)
        found = backend.exists("")
    except (StorageError, OSError, ValueError) as exc:
        raise UsageError(f"cannot open checkpoint root {root!r}: {exc}") from exc
    if not found:
        raise UsageError(f"checkpoint root {root!r} does not exist")
    try:
        backend.listdir("")
    except (StorageError, OSError) as exc:
        raise UsageError(f"checkpoint root {root!r} is not a readable directory: {exc}") from exc
    return backend


def checked_generation(backend: Backend, name: str) -> str:
    """Reject unsafe or malformed names and generations that do not exist (exit 2)."""
    try:
        check_generation_name(name)
    except UnsafeNameError as exc:
        raise UsageError(str(exc)) from exc
    if not backend.exists(name):
        raise UsageError(f"no generation {name!r} under {backend.root}")
    return name


def read_latest(backend: Backend) -> str | None:
    """The generation ``latest.json`` names, or None when absent or unreadable."""
    try:
        raw = backend.read_bytes(LATEST_NAME)
        return LatestPointer.model_validate_json(raw).generation
    except (OSError, ValueError, DistCkptError):
        return None


def update_number(info: GenerationInfo) -> int | None:
    if info.next_update is not None:
        return info.next_update
    match = _PENDING_RE.match(info.name)
    return int(match.group(1)) if match else None


def sorted_inventory(backend: Backend) -> list[GenerationInfo]:
    """All generations and pending directories, newest update number first."""
    def key(info: GenerationInfo) -> int:
        number = update_number(info)
        return -1 if number is None else number

    return sorted(inventory(backend, digests=False, key=key_from_env()), key=key, reverse=True)


def ls_record(info: GenerationInfo, latest: str | None, pins: dict[str, str]) -> dict[str, Any]:
    return {"name": info.name, "next_update": update_number(info), "state": info.state,
            "total_bytes": info.total_bytes, "latest": info.name == latest,
            "pin": pins.get(info.name), "reason": info.reason, "path": info.path}


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)] + [row[-1]]
        print("  ".join(cells).rstrip())


def cmd_ls(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    latest = read_latest(backend)
    pins = read_pins(backend)
    records = [ls_record(info, latest, pins) for info in sorted_inventory(backend)]
    mirror = mirror_status(args.root, records)
    if args.json:
        print(json.dumps({"root": backend.root, "latest": latest, "generations": records,
                          "mirror": mirror}, indent=1))
        return 0
    if not records:
        print(f"no generations under {backend.root}")
        return 0
    rows = [["", "GENERATION", "UPDATE", "BYTES", "SIZE", "STATE"]
            + (["PIN"] if pins else []) + (["MIRROR"] if mirror else []) + ["REASON"]]
    for rec in records:
        update = "-" if rec["next_update"] is None else str(rec["next_update"])
        size = "-" if rec["total_bytes"] is None else str(rec["total_bytes"])
        rows.append(["*" if rec["latest"] else "", rec["name"], update, size,
                     human_bytes(rec["total_bytes"]), rec["state"]]
                    + ([rec["pin"] or ""] if pins else [])
                    + ([rec.get("mirror", "")] if mirror else []) + [rec["reason"] or ""])
    print_table(rows)
    if mirror:
        print(f"mirror {mirror['url']}: last completed remote generation "
              f"{mirror['last_completed'] or '(none)'}")
    if latest is not None:
        print(f"* = {LATEST_NAME} -> {latest}")
    else:
        print(f"({LATEST_NAME} is missing or unreadable)")
    return 0


def mirror_status(root: str, records: list[dict]) -> dict | None:
    """For a local root with a mirror: mark each record mirrored / local-only (skipped)."""
    if is_remote(root):
        return None
    state = read_mirror_state(root)
    if not state.get("mirror"):
        return None
    try:
        remote = open_backend(state["mirror"])
        remote_committed = {i.name for i in inventory(remote, digests=False) if i.state == "committed"}
    except (StorageError, OSError, ValueError) as exc:
        raise UsageError(f"cannot read mirror {state['mirror']!r}: {exc}") from exc
    skipped = set(state.get("skipped", []))
    for rec in records:
        if rec["name"] in remote_committed:
            rec["mirror"] = "mirrored"
        elif rec["state"] == "committed":
            rec["mirror"] = "local-only (skipped)" if rec["name"] in skipped else "local-only"
    return {"url": state["mirror"], "last_completed": state.get("last_completed"),
            "skipped": sorted(skipped), "remote_committed": sorted(remote_committed)}


def default_committed(backend: Backend) -> str:
    for info in inventory(backend, digests=False):
        if info.state == "committed":
            return info.name
    raise UsageError(f"no committed generation under {backend.root}")


def default_any(backend: Backend) -> str:
    names = list_generations(backend)
    if not names:
        raise UsageError(f"no generation under {backend.root}")
    return names[0]


def manifest_summary(manifest: Manifest, latest: str | None) -> list[tuple[str, str]]:
    created = datetime.fromtimestamp(manifest.created_unix, tz=UTC).isoformat()
    contract = ", ".join(f"{k}={v}" for k, v in sorted(manifest.contract.items())) or "(empty)"
    mark = " (latest)" if manifest.generation == latest else ""
    return [
        ("generation", manifest.generation + mark),
        ("kind", manifest.kind),
        ("next_update", str(manifest.next_update)),
        ("tokens_seen", str(manifest.tokens_seen)),
        ("world_size", str(manifest.world_size)),
        ("torch_version", manifest.torch_version),
        ("dist_ckpt_version", manifest.dist_ckpt_version),
        ("components", ", ".join(manifest.components) or "(none)"),
        ("contract", contract),
        ("contract_digest", manifest.contract_digest),
        ("files", str(len(manifest.files))),
        ("total_bytes", f"{manifest.total_bytes} ({human_bytes(manifest.total_bytes)})"),
        ("save_duration_s", f"{manifest.save_duration_s:.3f}"),
        ("created", created),
    ]


def cmd_inspect(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    name = default_committed(backend) if args.generation is None else \
        checked_generation(backend, args.generation)
    manifest = read_manifest(backend, name, key=key_from_env())  # ValidationError -> exit 1
    if args.json:
        print(manifest.model_dump_json(indent=1))
        return 0
    for key, value in manifest_summary(manifest, read_latest(backend)):
        print(f"{key:<18} {value}")
    return 0


def verify_result(backend: Backend, name: str) -> dict[str, Any]:
    key = key_from_env()
    try:
        manifest = validate(backend, name, digests=True, key=key)
    except ValidationError as exc:
        return {"generation": name, "ok": False, "reason": str(exc), "path": exc.path}
    except OSError as exc:
        return {"generation": name, "ok": False, "reason": f"unreadable: {exc}",
                "path": getattr(exc, "filename", None)}
    reason = f"{len(manifest.files)} files, {manifest.total_bytes} bytes, sha256 verified"
    if key is not None:
        reason += f", signature verified (key from {KEY_ENV})"
    return {"generation": name, "ok": True, "reason": reason, "path": None}


def cmd_verify(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    name = default_any(backend) if args.generation is None else \
        checked_generation(backend, args.generation)
    result = verify_result(backend, name)
    if args.json:
        print(json.dumps(result))
    elif result["ok"]:
        print(f"{name}: OK ({result['reason']})")
    else:
        print(f"{name}: INVALID: {result['reason']}")
        if result["path"]:
            print(f"  offending file: {result['path']}")
    return 0 if result["ok"] else 1


def cmd_prune(args: argparse.Namespace) -> int:
    for flag, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1")
    backend = open_root(args.root)
    if isinstance(backend, ObjectStoreBackend):
        plan = prune_object_store(backend, keep_last=args.keep_last, keep_every=args.keep_every,
                                  key=key_from_env(), dry_run=args.dry_run)
        removed = {"generations": plan.generations, "incomplete": plan.incomplete,
                   "orphans": plan.orphans, "multipart_aborted": plan.multipart_aborted}
    else:
        if args.keep_last is None:
            raise UsageError("--keep-last is required for a local root")
        committed = [i.name for i in inventory(backend, digests=False, key=key_from_env())
                     if i.state == "committed"]
        removed = {"generations": prune(backend, committed, keep_last=args.keep_last,
                                        keep_every=args.keep_every, dry_run=args.dry_run)}
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, **removed}))
    else:
        for kind, names in removed.items():
            if isinstance(names, list):
                for name in names:
                    print(f"{verb} {kind[:-1] if kind.endswith('s') else kind}: {name}")
        if removed.get("multipart_aborted"):
            print(f"aborted {removed['multipart_aborted']} multipart upload(s)")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    if args.command == "unpin":  # a pruned-by-hand generation can still be unpinned
        try:
            check_generation_name(args.generation)
        except UnsafeNameError as exc:
            raise UsageError(str(exc)) from exc
        name = args.generation
    else:
        name = checked_generation(backend, args.generation)
    pins = set_pin(backend, name, None if args.command == "unpin" else args.label)
    if args.json:
        print(json.dumps({"pins": pins}))
    else:
        print(f"{'unpinned' if args.command == 'unpin' else 'pinned'} {name}; "
              f"{len(pins)} pinned generation(s) under {backend.root}")
    return 0


PLAN_EPILOG = """\
defaults and where they come from:
  --save-cost   median save_duration_s of the committed generations' manifests under ROOT
  --step-time   sum(duration_s) / sum(updates) of launch-log.jsonl in ROOT or ROOT/../..
                (the launcher keeps runs at LAUNCHROOT/runs/<id>/, its log at LAUNCHROOT)
  generation    total_bytes of the newest committed generation (--generation-bytes overrides)

durations take a unit: 500ms, 0.8s, 5m, 4h, 30d (no unit: seconds).

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


def plan_save_cost(given: float | None, committed: list[Manifest], root: str) -> tuple[float, str]:
    if given is not None:
        return given, "--save-cost"
    found = median_save_cost(m.save_duration_s for m in committed)
    if found is None:
        raise UsageError(f"no committed generation under {root} records a save duration; "
                         "pass --save-cost (e.g. --save-cost 30s)")
    return found[0], f"median of {found[1]} recorded saves"


def launch_log_dirs(root: str) -> list[str]:
    """ROOT itself, then ROOT's grandparent (the launcher's LAUNCHROOT for LAUNCHROOT/runs/<id>)."""
    if is_remote(root):
        scheme, _, path = root.partition("://")
        parts = path.rstrip("/").split("/")
        return [root] + ([f"{scheme}://{'/'.join(parts[:-2])}"] if len(parts) > 2 else [])
    path = os.path.abspath(root.removeprefix("file://"))
    return [path, os.path.dirname(os.path.dirname(path))]


def plan_step_time(given: float | None, root: str) -> tuple[float | None, str]:
    if given is not None:
        return given, "--step-time"
    for directory in launch_log_dirs(root):
        try:
            raw = open_backend(directory).read_bytes(LAUNCH_LOG)
        except (StorageError, OSError, ValueError):  # absent or unreadable: try the next place
            continue
        found = step_time_from_log(raw.decode("utf-8", errors="replace"))
        if found is not None:
            return found.step_time_s, (f"{directory.rstrip('/')}/{LAUNCH_LOG}: {found.duration_s:.0f} s "
                                       f"over {found.updates} updates in {found.launches} launch(es)")
    return None, f"unknown: pass --step-time (or launch with the launcher, whose {LAUNCH_LOG} records it)"


def plan_generation(given_bytes: int | None, newest: Manifest | None) -> tuple[int | None, str]:
    if given_bytes is not None:
        return given_bytes, "--generation-bytes"
    if newest is None:
        return None, "unknown: no committed generation; pass --generation-bytes"
    return newest.total_bytes, f"newest committed generation {newest.generation}"


def read_tiers_file(path: str | None) -> list[Tier]:
    if path is None:
        return []
    try:
        with open(path, "rb") as handle:
            return parse_tiers(handle.read())
    except OSError as exc:
        raise UsageError(f"cannot read tiers file {path!r}: {exc}") from exc
    except ValueError as exc:
        raise UsageError(f"tiers file {path!r} is malformed: {exc}") from exc


def build_plan(args: argparse.Namespace, backend: Backend) -> Plan:
    committed = [i.manifest for i in sorted_inventory(backend) if i.state == "committed" and i.manifest]
    newest = committed[0] if committed else None
    save_cost, save_cost_src = plan_save_cost(args.save_cost, committed, backend.root)
    step_time, step_time_src = plan_step_time(args.step_time, args.root)
    size, size_src = plan_generation(args.generation_bytes, newest)
    sources = {
        "save_cost_s": save_cost_src, "step_time_s": step_time_src, "generation_bytes": size_src,
        "mtbf_s": "--mtbf" if args.mtbf is not None else "default 4h",
        "run_length_s": "--run-length" if args.run_length is not None else "default 30d",
        "keep_last": "--keep-last" if args.keep_last is not None else "default 3",
        "files_per_generation": "unknown: no committed generation" if newest is None else
        f"newest committed generation {newest.generation}: {len(newest.files)} files + manifest"}
    try:
        return make_plan(
            save_cost_s=save_cost, mtbf_s=args.mtbf or 4 * 3600.0,
            run_length_s=args.run_length or 30 * 86400.0, step_time_s=step_time,
            generation_bytes=size, files_per_generation=None if newest is None else len(newest.files) + 1,
            keep_last=3 if args.keep_last is None else args.keep_last, keep_every=args.keep_every,
            tiers=read_tiers_file(args.tiers), sources=sources)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def human_seconds(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds:.1f} s ({seconds / size:.1f} {unit})"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.3g} s"


def plan_head_lines(plan: Plan) -> list[str]:
    src = plan.sources
    step = "-" if plan.step_time_s is None else f"{plan.step_time_s:.4g} s"
    updates = f" = {plan.interval_updates} updates" if plan.interval_updates is not None else \
        " (in updates: pass --step-time)"
    return [
        f"  save cost C      {human_seconds(plan.save_cost_s)}  [{src['save_cost_s']}]",
        f"  MTBF M           {human_seconds(plan.mtbf_s)}  [{src['mtbf_s']}]",
        f"  step time        {step}  [{src['step_time_s']}]",
        f"  run length       {human_seconds(plan.run_length_s)}  [{src['run_length_s']}]",
        f"interval T* = sqrt(2 C M) = {human_seconds(plan.interval_s)}{updates}",
        f"time lost at T*  {plan.lost_fraction:.2%} (saving C/T* {plan.lost_saving_fraction:.2%} "
        f"+ rework T*/2M {plan.lost_rework_fraction:.2%})",
        f"over the run     {plan.saves:.0f} saves, {plan.restores:.1f} expected restores (run length / M)",
    ]


def milestone_line(plan: Plan) -> str:
    if plan.keep_every is None:
        return "0 (no --keep-every)"
    if plan.run_updates is None:
        return "0 counted: the run length in updates needs a step time (--step-time)"
    return (f"{plan.milestones}: multiples of --keep-every {plan.keep_every} within the run's "
            f"{plan.run_updates} updates (assumes a save lands on each)")


def plan_disk_lines(plan: Plan) -> list[str]:
    if plan.generation_bytes is None or plan.disk_bytes is None:
        return [f"disk needed      {plan.sources['generation_bytes']}"]
    size = human_bytes(plan.generation_bytes)
    return [
        f"disk needed      {human_bytes(plan.disk_bytes)} = ({plan.keep_last} kept + {plan.milestones} "
        f"milestones) x {size} + {size} staging",
        f"  kept           {plan.keep_last} newest generations (--keep-last) [{plan.sources['keep_last']}]",
        f"  milestones     {milestone_line(plan)}",
        f"  generation     {size} = {plan.generation_bytes} bytes [{plan.sources['generation_bytes']}]",
        "  staging        one more generation: a save in flight",
    ]


def usd(amount: float) -> str:
    # cents would hide small per-tier costs, so three significant digits below $10
    if amount >= 10:
        return f"${amount:,.2f}"
    return f"${amount:.3g}" if amount >= 0.01 or amount == 0 else "<$0.01"


def tier_lines(tier: TierPlan, plan: Plan) -> list[str]:
    lines = [f"tier {tier.name!r} (reads {human_bytes(int(tier.read_bytes_per_s))}/s)"]
    if tier.restore_s is not None and tier.gb_months is not None:
        lines += [f"  restore one generation  {human_seconds(tier.restore_s)}",
                  f"  stored                  {tier.gb_months:.2f} GB-months "
                  f"(average {plan.keep_last} kept + {plan.milestones}/2 milestones)"]
    if tier.put_requests is not None and tier.get_requests is not None:
        files = plan.files_per_generation
        lines += [f"  PUT requests            {tier.put_requests:.0f} "
                  f"({plan.saves:.0f} saves x {files} files)",
                  f"  GET requests            {tier.get_requests:.0f} "
                  f"({plan.restores:.1f} restores x {files} files)"]
    costs = [(label, value) for label, value in (("storage", tier.storage_usd), ("PUT", tier.put_usd),
                                                 ("GET", tier.get_usd)) if value is not None]
    if costs and tier.total_usd is not None:
        parts = " + ".join(f"{usd(value)} {label}" for label, value in costs)
        lines.append(f"  cost over the run       {parts} = {usd(tier.total_usd)}")
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    plan = build_plan(args, backend)
    if args.json:
        print(json.dumps({"root": backend.root, **asdict(plan)}, indent=1))
        return 0
    lines = [f"cadence plan for {backend.root}", *plan_head_lines(plan), *plan_disk_lines(plan)]
    for tier in plan.tiers:
        lines += tier_lines(tier, plan)
    lines += [f"note: {note}" for note in plan.notes]
    print("\n".join(lines))
    return 0


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="how often to save, the time lost, the disk and tier costs",
                          description="Young's checkpoint interval T* = sqrt(2 C M), the expected "
                          "time lost at T*,\nthe disk needed under ROOT and per-tier figures.",
                          epilog=PLAN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.set_defaults(func=cmd_plan)
    plan.add_argument("--mtbf", type=duration_arg, default=None, metavar="DUR",
                      help="mean time between failures of the job (default 4h)")
    plan.add_argument("--save-cost", type=duration_arg, default=None, metavar="DUR",
                      help="time training stalls per save, C (default: median recorded under ROOT)")
    plan.add_argument("--step-time", type=duration_arg, default=None, metavar="DUR",
                      help="seconds per update (default: from the launcher's launch-log.jsonl)")
    plan.add_argument("--run-length", type=duration_arg, default=None, metavar="DUR",
                      help="wall time of the whole run (default 30d)")
    plan.add_argument("--keep-last", type=int, default=None, metavar="K",
                      help="newest generations kept by pruning (default 3)")
    plan.add_argument("--keep-every", type=int, default=None, metavar="N",
                      help="milestones kept: update numbers that are multiples of N")
    plan.add_argument("--generation-bytes", type=byte_count_arg, default=None, metavar="BYTES",
                      help="size of one generation (default: the newest committed one)")
    plan.add_argument("--tiers", default=None, metavar="FILE", help="JSON file of per-tier rates (below)")
    return plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    ls = sub.add_parser("ls", help="list generations under ROOT")
    ls.set_defaults(func=cmd_ls)
    inspect = sub.add_parser("inspect", help="summarise a generation's manifest")
    inspect.set_defaults(func=cmd_inspect)
    verify = sub.add_parser("verify", help="fully validate a generation (sizes and sha256)")
    verify.set_defaults(func=cmd_verify)
    prune_cmd = sub.add_parser("prune", help="delete old generations and leftovers of failed uploads")
    prune_cmd.set_defaults(func=cmd_prune)
    prune_cmd.add_argument("--keep-last", type=int, default=None, metavar="K",
                           help="keep the newest K committed generations")
    prune_cmd.add_argument("--keep-every", type=int, default=None, metavar="N",
                           help="also keep milestones: update numbers that are multiples of N")
    prune_cmd.add_argument("--dry-run", action="store_true", help="only print what would go")
    pin = sub.add_parser("pin", help="protect a committed generation from pruning")
    pin.set_defaults(func=cmd_pin)
    pin.add_argument("--label", default="pinned", help="why it is kept (best, final, ...)")
    unpin = sub.add_parser("unpin", help="let pruning delete a generation again")
    unpin.set_defaults(func=cmd_pin)
    plan = add_plan_parser(sub)
    for cmd in (ls, inspect, verify, prune_cmd, pin, unpin, plan):
        cmd.add_argument("root", metavar="ROOT", help="checkpoint root (path or s3:// URL)")
    for cmd in (pin, unpin):
        cmd.add_argument("generation", metavar="GEN", help="generation name")
    inspect.add_argument("generation", metavar="GEN", nargs="?",
                         help="generation name (default: newest committed)")
    verify.add_argument("generation", metavar="GEN", nargs="?",
                        help="generation name (default: newest, any state)")
    for cmd in (ls, inspect, verify, prune_cmd, pin, unpin, plan):
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors itself (status 2), --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        error("a command is required (ls, inspect, verify, prune, pin, unpin, plan)")
        return 2
    try:
        return int(args.func(args))
    except UsageError as exc:
        error(str(exc))
        return 2
    except ValidationError as exc:
        error(str(exc) + (f" (file {exc.path})" if exc.path else ""))
        return 1
    except (DistCkptError, OSError) as exc:
        error(str(exc) or type(exc).__name__)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
