"""``dist-ckpt`` command line: list, inspect, verify, pin and prune the generations under a root,
and plan the checkpoint cadence (``plan``).

Exit codes: 0 success; 1 a generation is invalid (or its manifest unreadable); 2 usage errors
(missing root, unsafe or unknown generation name, unsupported storage URL).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import UTC, datetime
from typing import Any

from .cli_common import PROG, UsageError, human_bytes, open_root
from .cli_plan import add_plan_parser
from .errors import DistCkptError, StorageError, UnsafeNameError, ValidationError
from .inventory import GenerationInfo, inventory
from .manifest import LATEST_NAME, PENDING_PREFIX, LatestPointer, Manifest, check_generation_name
from .mirror import read_mirror_state
from .retention import prune, prune_object_store, read_pins, set_pin
from .signing import KEY_ENV, key_from_env
from .storage.base import Backend, is_remote, open_backend
from .storage.objectstore import ObjectStoreBackend
from .validate import list_generations, read_manifest, validate

_PENDING_RE = re.compile(rf"^{re.escape(PENDING_PREFIX)}gen-(\d{{12}})(?:-|$)")


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
