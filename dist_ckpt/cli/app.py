"""``dist-ckpt`` command line: the generations under a checkpoint root, and its cadence.

List, inspect, verify, pin, prune, quarantine (move aside) and remove (invalid only) the
generations under a root; plan the checkpoint cadence (``plan``); list the launcher's runs
and their starts (``runs``).

Exit codes: 0 success; 1 a generation is invalid (or its manifest unreadable) or the request
was refused (a valid generation to ``rm``, a pinned one to ``quarantine``, ...); 2 usage errors
(missing root, unsafe or unknown generation name, unsupported storage URL, a missing flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .. import progress
from ..errors import DistCkptError, StorageError, ValidationError
from ..format.inventory import GenerationInfo, inventory
from ..format.manifest import (
    LATEST_NAME,
    OBJECTS_DIR,
    REASON_NAME,
    REJECTED_DIR,
    parse_generation,
    read_latest_name,
    rejected_generation,
)
from ..format.objects import listed_objects
from ..format.signing import key_from_env
from ..launcher_api import RUNS_DIR
from ..lifecycle.retention import prune, read_pins
from ..save.replay import read_mirror_state
from ..storage.base import Store, StoreReader, open_store
from ..version import __version__
from .common import (
    PROG,
    Refused,
    UsageError,
    error,
    human_bytes,
    is_directory,
    latest_warnings,
    open_root,
    open_root_tier,
    print_table,
    sorted_inventory,
    update_number,
    warn,
)
from .diff import add_diff_parser
from .export import add_export_parser
from .inspection import cmd_inspect, cmd_verify
from .launch_root import print_runs, run_records
from .ops import cmd_pin, cmd_quarantine, cmd_rm
from .plan import add_plan_parser
from .rehearse import add_rehearse_parser
from .runs import add_runs_parser

FOOTNOTE = "ls checks sizes; `dist-ckpt verify` checks digests"
SHARED_NOTE = (f"OWN: bytes below the generation (what deleting it frees); SHARED: bytes of the "
               f"shared objects it references under {OBJECTS_DIR}/ (kept while any generation "
               "lists them)")
PROGRESS_COMMANDS = frozenset({"verify", "export", "diff"})  # long work: bytes and rate


def ls_record(info: GenerationInfo, latest: str | None, pins: dict[str, str]) -> dict[str, Any]:
    # own_bytes + referenced_bytes = total_bytes; the referenced (shared-object) bytes are
    # counted in every generation that lists them, so they do not add up across generations
    return {"name": info.name, "next_update": update_number(info), "state": info.state,
            "total_bytes": info.total_bytes, "own_bytes": info.own_bytes,
            "referenced_bytes": info.referenced_bytes, "latest": info.name == latest,
            "pin": pins.get(info.name), "reason": info.reason, "path": info.path}


def quarantined_records(store: StoreReader) -> list[dict[str, Any]]:
    """Entries under ``ROOT/rejected/`` (tiers that keep rejected generations), newest update
    number first."""
    try:
        entries = store.listdir(REJECTED_DIR) if store.exists(REJECTED_DIR) else []
    except (StorageError, OSError):
        entries = []
    records = []
    for entry in sorted(entries, reverse=True):  # same generation: newest move first
        generation = rejected_generation(entry)
        rel = f"{REJECTED_DIR}/{entry}"
        if generation is None or not is_directory(store, rel):
            continue
        records.append({"name": entry, "generation": generation,
                        "next_update": parse_generation(generation), "state": "quarantined",
                        "total_bytes": store.tree_size(rel), "latest": False,
                        "pin": None, "reason": first_reason_line(store, rel), "path": rel})
    return sorted(records, key=lambda rec: rec["next_update"], reverse=True)


def first_reason_line(store: StoreReader, entry: str) -> str:
    try:
        text = store.read_bytes(f"{entry}/{REASON_NAME}")[:1000].decode("utf-8", errors="replace")
    except (FileNotFoundError, StorageError, OSError):
        return f"(no {REASON_NAME})"
    return text.splitlines()[0].strip() if text.strip() else "(empty reason)"


def cmd_ls(args: argparse.Namespace) -> int:
    store = open_root(args.root)
    latest = read_latest_name(store)
    pins = read_pins(store)
    records = [ls_record(info, latest, pins) for info in sorted_inventory(store)]
    quarantined = quarantined_records(store)
    mirror = mirror_status(store, records)
    warnings = latest_warnings(store, latest)
    runs = run_records(store, key_from_env())  # a launcher root: its runs/
    objects = objects_record(store)
    if args.json:
        print(json.dumps({"root": store.root, "latest": latest, "generations": records,
                          "quarantined": quarantined, "mirror": mirror, "warnings": warnings,
                          "objects": objects, **({"launcher_runs": runs} if runs else {})}, indent=1))
        return 0
    for message in warnings:
        warn(message)
    if not records and not quarantined:
        if runs:
            print_runs(store.root, runs)
        else:
            print(f"no generations under {store.root}")
        return 0
    print_ls_table(records, quarantined, pins, mirror)
    if objects["count"]:
        print(f"shared objects: {objects['count']} under {OBJECTS_DIR}/, "
              f"{human_bytes(objects['bytes'])} (stored once, whatever number of generations lists them)")
    if mirror:
        print(f"mirror {mirror['url']}: last completed remote generation "
              f"{mirror['last_completed'] or '(none)'}")
    if latest is not None:
        print(f"* = {LATEST_NAME} -> {latest}")
    else:
        print(f"({LATEST_NAME} is missing or unreadable)")
    print(FOOTNOTE)
    if runs:  # a run continued in place beside the launcher's runs/
        print(f"this is also a launcher root: {len(runs)} more run(s) under {RUNS_DIR}/; "
              f"`dist-ckpt ls {store.root}/{RUNS_DIR}/ID` lists one")
    return 0


def objects_record(store: StoreReader) -> dict[str, int]:
    """The shared objects under ``ROOT/objects/``: how many, and their bytes on the store
    (each counted once, however many generations reference it)."""
    count = len(listed_objects(store))
    try:
        size = store.tree_size(OBJECTS_DIR) if count else 0
    except (StorageError, OSError):
        size = 0
    return {"count": count, "bytes": size}


def print_ls_table(records: list[dict], quarantined: list[dict], pins: dict[str, str],
                   mirror: dict | None) -> None:
    # OWN and SHARED only where some generation references shared objects: a root of full
    # generations lists as it always did
    shared = any(rec.get("referenced_bytes") for rec in records)
    rows = [["", "GENERATION", "UPDATE", "BYTES", "SIZE"] + (["OWN", "SHARED"] if shared else [])
            + ["STATE"] + (["PIN"] if pins else []) + (["MIRROR"] if mirror else []) + ["REASON"]]
    for rec in records + quarantined:
        update = "-" if rec["next_update"] is None else str(rec["next_update"])
        size = "-" if rec["total_bytes"] is None else str(rec["total_bytes"])
        # a quarantined row is named by its path: what `dist-ckpt rm` takes to delete it
        name = rec["path"] if rec["state"] == "quarantined" else rec["name"]
        split = [human_bytes(rec.get("own_bytes")), human_bytes(rec.get("referenced_bytes"))]
        rows.append(["*" if rec["latest"] else "", name, update, size, human_bytes(rec["total_bytes"])]
                    + (split if shared else []) + [rec["state"]]
                    + ([rec["pin"] or ""] if pins else [])
                    + ([rec.get("mirror", "")] if mirror else []) + [rec["reason"] or ""])
    print_table(rows)
    if shared:
        print(SHARED_NOTE)


def mirror_status(store: StoreReader, records: list[dict]) -> dict | None:
    """For a root with a mirror: mark each record mirrored / local-only (skipped)."""
    state = read_mirror_state(store)
    if not state.get("mirror"):
        return None
    try:
        remote = open_store(state["mirror"])
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


def cmd_prune(args: argparse.Namespace) -> int:
    for flag, value in (("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1")
    tier = open_root_tier(args.root)
    if args.keep_last is None and not tier.leaves_debris:
        raise UsageError("a local root needs --keep-last K, e.g. --keep-last 3: the newest K "
                         "committed generations stay (pinned ones and --keep-every milestones too)")
    key = key_from_env()
    committed = [i.name for i in inventory(tier.store, digests=False, key=key) if i.state == "committed"]
    plan = prune(tier, keep_last=args.keep_last, keep_every=args.keep_every, key=key,
                 committed=committed, dry_run=args.dry_run)
    removed: dict[str, Any] = {"generations": plan.generations}
    if tier.leaves_debris or plan.incomplete:
        removed.update(incomplete=plan.incomplete)
    if tier.leaves_debris:
        removed.update(orphans=plan.orphans, multipart_aborted=plan.multipart_aborted)
    if plan.objects:  # shared objects of incremental generations no kept one references
        removed.update(objects=plan.objects)
    verb = "would remove" if args.dry_run else "removed"
    kept = len(committed) - len(plan.generations)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, **removed, "kept": kept}))
        return 0
    for kind, names in removed.items():
        if isinstance(names, list):
            for name in names:
                print(f"{verb} {kind[:-1] if kind.endswith('s') else kind}: {name}")
    if removed.get("multipart_aborted"):
        print(f"aborted {removed['multipart_aborted']} multipart upload(s)")
    if not any(removed.values()):
        print(f"nothing to prune: {kept} generation(s) kept ({kept_because(args, tier.store)})")
    return 0


def kept_because(args: argparse.Namespace, store: Store) -> str:
    """Why nothing goes, in the flags' words (prune with nothing to remove must still answer)."""
    reasons = [f"--keep-last {args.keep_last}" if args.keep_last is not None
               else "no --keep-last: only leftovers of failed uploads go"]
    if args.keep_every:
        reasons.append(f"--keep-every {args.keep_every} milestones")
    pins = read_pins(store)
    if pins:
        reasons.append(f"{len(pins)} pinned")
    return ", ".join(reasons)


LS_EPILOG = f"""\
states: committed (structure and sizes check out), invalid, pending (a save in flight or
abandoned), quarantined (moved aside to ROOT/{REJECTED_DIR}/ by restore or `dist-ckpt quarantine`;
named by that path, the reason is the first line of its {REASON_NAME}).
{FOOTNOTE}.

A launcher root (python -m launch --checkpoint-root, with {RUNS_DIR}/ below it): ls lists its
runs, each with its newest committed generation and DONE state; `dist-ckpt ls
LAUNCHROOT/{RUNS_DIR}/ID` lists one run (--json: "launcher_runs").

--json prints {{"root", "latest", "generations", "quarantined", "mirror", "warnings"}}:
quarantined entries are listed apart from the generations, each with name (its directory
under {REJECTED_DIR}/), generation, next_update, state "quarantined", total_bytes, reason and path;
warnings names problems that do not change the exit status, such as a {LATEST_NAME} that
points to a missing generation (text output: on stderr).

Incremental generations (docs/incremental.md) reference shared objects under
ROOT/{OBJECTS_DIR}/: each generation record carries own_bytes (its files below the
generation: what deleting it frees) and referenced_bytes (the shared objects it lists;
own_bytes + referenced_bytes = total_bytes; null for an invalid one), and "objects" gives
the count and bytes of ROOT/{OBJECTS_DIR}/ (each object once). The text table shows them as
OWN and SHARED when some generation references an object.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = [*add_reading_parsers(sub), *add_changing_parsers(sub)]
    plan = add_plan_parser(sub)
    add_root(plan)
    runs = add_runs_parser(sub)
    for cmd in [*commands, plan, runs]:
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
    add_rehearse_parser(sub)
    add_export_parser(sub)
    add_diff_parser(sub)
    return parser


def add_root(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("root", metavar="ROOT", help="checkpoint root (path or s3:// URL)")


def add_reading_parsers(sub: Any) -> list[argparse.ArgumentParser]:
    ls = sub.add_parser("ls", help="list generations under ROOT", epilog=LS_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.set_defaults(func=cmd_ls)
    inspect = sub.add_parser(
        "inspect", help="summarise a generation: manifest, data position, extras, pin, tier",
        description="--json prints the manifest plus latest, data_position, extras_keys, pin, "
                    "tier, state_error and warnings")
    inspect.set_defaults(func=cmd_inspect)
    verify = sub.add_parser("verify", help="fully validate a generation (sizes and digests)")
    verify.set_defaults(func=cmd_verify)
    verify.add_argument("--all", action="store_true",
                        help="check every generation; exit 0 only if all are valid")
    verify.add_argument("--newest-valid", action="store_true",
                        help="check the newest committed generation alone, passing over newer "
                             "broken ones (without GEN: latest.json's and every newer one)")
    for cmd in (ls, inspect, verify):
        add_root(cmd)
    for cmd in (inspect, verify):
        cmd.add_argument("generation", metavar="GEN", nargs="?",
                         help="generation name: gen-000000003300, gen-3300 or 3300 (default: "
                              + ("the newest committed one, else the newest)" if cmd is inspect
                                 else "what latest.json names, and every newer one)"))
    return [ls, inspect, verify]


def add_changing_parsers(sub: Any) -> list[argparse.ArgumentParser]:
    prune_cmd = sub.add_parser("prune", help="delete old generations and leftovers of failed uploads")
    prune_cmd.set_defaults(func=cmd_prune)
    prune_cmd.add_argument("--keep-last", type=int, default=None, metavar="K",
                           help="keep the newest K committed generations (required for a local root)")
    prune_cmd.add_argument("--keep-every", type=int, default=None, metavar="N",
                           help="also keep milestones: update numbers that are multiples of N")
    prune_cmd.add_argument("--dry-run", action="store_true", help="only print what would go")
    pin = sub.add_parser("pin", help="protect a committed generation from pruning")
    pin.set_defaults(func=cmd_pin)
    pin.add_argument("--label", default="pinned", help="why it is kept (best, final, ...)")
    unpin = sub.add_parser("unpin", help="let pruning delete a generation again")
    unpin.set_defaults(func=cmd_pin)
    quarantine_cmd = sub.add_parser(
        "quarantine", help=f"move a generation aside to ROOT/{REJECTED_DIR}/",
        description="Refuses a pinned generation and the valid one latest.json points to, unless "
                    "--force (a pinned one is then unpinned).")
    quarantine_cmd.set_defaults(func=cmd_quarantine)
    quarantine_cmd.add_argument("--reason", default=None, metavar="TEXT", help=f"written to {REASON_NAME}")
    quarantine_cmd.add_argument("--force", action="store_true", help="move a pinned or the latest one too")
    rm = sub.add_parser(
        "rm", help="delete a generation or quarantined entry that fails validation",
        description="Deletes only what fails the full check (sizes and digests; signatures are not "
                    "checked: another key's generation is not damaged). A valid one exits 1.")
    rm.set_defaults(func=cmd_rm)
    rm.add_argument("--invalid-only", action="store_true",
                    help="required: the promise that nothing valid is deleted")
    for cmd in (prune_cmd, pin, unpin, quarantine_cmd, rm):
        add_root(cmd)
    for cmd in (pin, unpin, quarantine_cmd):
        cmd.add_argument("generation", metavar="GEN", help="generation name (gen-3300 or 3300 too)")
    rm.add_argument("name", metavar="NAME",
                    help=f"generation name, or a quarantined entry ({REJECTED_DIR}/ENTRY or ENTRY)")
    return [prune_cmd, pin, unpin, quarantine_cmd, rm]




def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports usage errors itself (status 2), --help (0)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_usage(sys.stderr)
        error("a command is required (see --help)")
        return 2
    try:
        shown = sys.stderr.isatty() and not getattr(args, "json", False)
        with progress.bar(args.command, enabled=shown and args.command in PROGRESS_COMMANDS):
            return int(args.func(args))
    except UsageError as exc:
        error(str(exc))
        return 2
    except Refused as exc:
        error(str(exc))
        return 1
    except ValidationError as exc:
        error(str(exc) + (f" (file {exc.path})" if exc.path else ""))
        return 1
    except (DistCkptError, OSError) as exc:
        error(str(exc) or type(exc).__name__)
        return 1
    except UnicodeEncodeError as exc:  # a name that is not UTF-8 (from the root or the command line)
        error(f"cannot print a name that is not valid UTF-8: {exc}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
