"""``dist-ckpt`` command line: the generations under a checkpoint root, and its cadence.

List, inspect, verify, pin, prune, quarantine (move aside under ``ROOT/rejected/``),
unquarantine (put back) and remove (invalid only, or a quarantined entry) the generations
under a root; plan the checkpoint cadence (``plan``); list the launcher's runs and their
starts (``runs``).

Exit codes: 0 success; 1 a generation is invalid (or its manifest unreadable) or the request
was refused (a valid generation to ``rm``, a pinned one to ``quarantine``, ...); 2 usage errors
(missing root, unsafe or unknown generation name, unsupported storage URL, a missing flag).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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
)
from ..format.objects import listed_objects
from ..format.quarantine import list_quarantined, reason_line
from ..format.signing import key_from_env
from ..launcher_api import RUNS_DIR
from ..lifecycle.retention import prune, read_pins
from ..replay.record import read_mirror_state
from ..storage.base import StoreReader, open_store
from ..tiers import CommitTier
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
from .costs import parse_duration
from .diff import add_diff_parser
from .export import add_export_parser
from .forecast import add_plan_parser
from .inspection import cmd_inspect, cmd_verify
from .launch_root import print_runs, run_records
from .ops import cmd_pin, cmd_quarantine, cmd_rm, cmd_unquarantine
from .rehearse import add_rehearse_parser
from .runs import add_runs_parser

FOOTNOTE = "ls checks sizes; `dist-ckpt verify` checks digests"
SHARED_NOTE = (f"OWN: bytes below the generation (what deleting it frees); SHARED: bytes of the "
               f"shared objects it references under {OBJECTS_DIR}/ (kept while any generation "
               "lists them)")
QUARANTINE_NOTE = (f"quarantined: moved aside under {REJECTED_DIR}/ (`dist-ckpt unquarantine ROOT ENTRY` "
                   "puts a generation back, `dist-ckpt rm ROOT ENTRY --quarantined` deletes an entry)")
PROGRESS_COMMANDS = frozenset({"verify", "export", "diff"})  # long work: bytes and rate


def ls_record(info: GenerationInfo, latest: str | None, pins: dict[str, str]) -> dict[str, Any]:
    # own_bytes + referenced_bytes = total_bytes; the referenced (shared-object) bytes are
    # counted in every generation that lists them, so they do not add up across generations
    return {"name": info.name, "next_update": update_number(info), "state": info.state,
            "total_bytes": info.total_bytes, "own_bytes": info.own_bytes,
            "referenced_bytes": info.referenced_bytes, "latest": info.name == latest,
            "pin": pins.get(info.name), "reason": info.reason, "path": info.path}


def quarantined_records(store: StoreReader) -> list[dict[str, Any]]:
    """Entries under ``ROOT/rejected/`` (tiers that keep quarantined ones), both kinds: a
    generation moved aside, and the damaged files a restore's repair replaced; newest update
    number first, and for one generation the newest quarantine first."""
    return [{"name": entry.name, "generation": entry.generation, "kind": entry.kind,
             "time": entry.time_text, "next_update": parse_generation(entry.generation),
             "state": "quarantined", "total_bytes": store.tree_size(entry.path), "latest": False,
             "pin": None, "reason": reason_line(store, entry), "path": entry.path}
            for entry in list_quarantined(store) if is_directory(store, entry.path)]


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
    if quarantined:
        print(QUARANTINE_NOTE)
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
        state = "quarantined files" if rec.get("kind") == "files" else rec["state"]
        split = [human_bytes(rec.get("own_bytes")), human_bytes(rec.get("referenced_bytes"))]
        rows.append(["*" if rec["latest"] else "", name, update, size, human_bytes(rec["total_bytes"])]
                    + (split if shared else []) + [state]
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
    age = quarantine_age(args.quarantined_older_than)
    tier = open_root_tier(args.root)
    if args.keep_last is None and age is None and not tier.leaves_debris:
        raise UsageError("a local root needs --keep-last K, e.g. --keep-last 3: the newest K "
                         "committed generations stay (pinned ones and --keep-every milestones too)")
    key = key_from_env()
    committed = [i.name for i in inventory(tier.store, digests=False, key=key) if i.state == "committed"]
    removals = prune(tier, keep_last=args.keep_last, keep_every=args.keep_every, key=key,
                     committed=committed, dry_run=args.dry_run,
                     quarantined_before=None if age is None else time.time() - age)
    removed: dict[str, Any] = {"generations": removals.generations}
    if age is not None:
        removed.update(quarantined=removals.quarantined)
    if tier.leaves_debris or removals.incomplete:
        removed.update(incomplete=removals.incomplete)
    if tier.leaves_debris:
        removed.update(orphans=removals.orphans, multipart_aborted=removals.multipart_aborted)
    if removals.objects:  # shared objects of incremental generations no kept one references
        removed.update(objects=removals.objects)
    verb = "would remove" if args.dry_run else "removed"
    kept = len(committed) - len(removals.generations)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, **removed, "kept": kept}))
        return 0
    for kind, names in removed.items():
        if isinstance(names, list):
            label = "quarantined entry" if kind == "quarantined" else kind.removesuffix("s")
            for name in names:
                print(f"{verb} {label}: {name}")
    if removed.get("multipart_aborted"):
        print(f"aborted {removed['multipart_aborted']} multipart upload(s)")
    if not any(removed.values()):
        print(f"nothing to prune: {kept} generation(s) kept ({kept_because(args, tier)})")
    return 0


def quarantine_age(text: str | None) -> float | None:
    """``--quarantined-older-than`` in seconds (None: not given)."""
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise UsageError(f"--quarantined-older-than: {exc}") from exc


def kept_because(args: argparse.Namespace, tier: CommitTier) -> str:
    """Why nothing goes, in the flags' words (prune with nothing to remove must still answer)."""
    no_keep_last = ("no --keep-last: only leftovers of failed uploads go" if tier.leaves_debris
                    else "no --keep-last: no generation goes")
    reasons = [f"--keep-last {args.keep_last}" if args.keep_last is not None else no_keep_last]
    if args.keep_every:
        reasons.append(f"--keep-every {args.keep_every} milestones")
    pins = read_pins(tier.store)
    if pins:
        reasons.append(f"{len(pins)} pinned")
    if args.quarantined_older_than is not None:
        count = len(list_quarantined(tier.store))
        reasons.append(f"{count} quarantined {'entry' if count == 1 else 'entries'} newer than "
                       f"{args.quarantined_older_than}")
    return ", ".join(reasons)


LS_EPILOG = f"""\
states: committed (structure and sizes check out), invalid, pending (a save in flight or
abandoned), quarantined (moved aside under ROOT/{REJECTED_DIR}/ by restore or `dist-ckpt
quarantine`), quarantined files (damaged files a restore's repair replaced, the generation
itself staying committed). A quarantined row is named by its path, which holds the generation
and the UTC time of the quarantine; the reason is the first line of its {REASON_NAME}.
{FOOTNOTE}.

A launcher root (python -m launch --checkpoint-root, with {RUNS_DIR}/ below it): ls lists its
runs, each with its newest committed generation and DONE state; `dist-ckpt ls
LAUNCHROOT/{RUNS_DIR}/ID` lists one run (--json: "launcher_runs").

--json prints {{"root", "latest", "generations", "quarantined", "mirror", "warnings"}}:
quarantined entries are listed apart from the generations, each with name (its directory
under {REJECTED_DIR}/), generation, kind ("generation" or "files"), time (UTC, ISO 8601),
next_update, state "quarantined", total_bytes, reason and path;
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
                           help="keep the newest K committed generations (required for a local root, "
                                "unless --quarantined-older-than is given)")
    prune_cmd.add_argument("--keep-every", type=int, default=None, metavar="N",
                           help="also keep milestones: update numbers that are multiples of N")
    prune_cmd.add_argument("--quarantined-older-than", default=None, metavar="DURATION",
                           help=f"also delete the entries under ROOT/{REJECTED_DIR}/ (both kinds) "
                                "quarantined longer ago than DURATION (30d, 12h, ...; the time in "
                                "the entry's name)")
    prune_cmd.add_argument("--dry-run", action="store_true", help="only print what would go")
    pin = sub.add_parser("pin", help="protect a committed generation from pruning")
    pin.set_defaults(func=cmd_pin)
    pin.add_argument("--label", default="pinned", help="why it is kept (best, final, ...)")
    unpin = sub.add_parser("unpin", help="let pruning delete a generation again")
    unpin.set_defaults(func=cmd_pin)
    quarantine_cmd = sub.add_parser(
        "quarantine", help=f"move a generation aside under ROOT/{REJECTED_DIR}/ (kept, not deleted)",
        description="Refuses a pinned generation and the valid one latest.json points to, unless "
                    "--force (a pinned one is then unpinned). `dist-ckpt unquarantine` puts it back.")
    quarantine_cmd.set_defaults(func=cmd_quarantine)
    quarantine_cmd.add_argument("--reason", default=None, metavar="TEXT", help=f"written to {REASON_NAME}")
    quarantine_cmd.add_argument("--force", action="store_true", help="move a pinned or the latest one too")
    unquarantine = sub.add_parser(
        "unquarantine", help=f"put a quarantined generation back from ROOT/{REJECTED_DIR}/",
        description="Puts a quarantined generation back under its name, only where no generation "
                    "of that name is, only if it validates (sizes, digests; with "
                    "DIST_CKPT_HMAC_KEY its signature), in one step (a rename; an object store: "
                    "copied back, the manifest created last). latest.json moves to it only when "
                    "it is the newest. An entry of damaged files has nothing to put back: rm it.")
    unquarantine.set_defaults(func=cmd_unquarantine)
    rm = sub.add_parser(
        "rm", help="delete a generation or quarantined entry that fails validation, or any "
                   "quarantined entry",
        description="--invalid-only deletes only what fails the full check (sizes and digests; "
                    "signatures are not checked: another key's generation is not damaged); a valid "
                    f"one exits 1. --quarantined deletes an entry under ROOT/{REJECTED_DIR}/, valid "
                    "or not, and nothing else.")
    rm.set_defaults(func=cmd_rm)
    rm_mode = rm.add_mutually_exclusive_group()
    rm_mode.add_argument("--invalid-only", action="store_true",
                         help="the promise that nothing valid is deleted (one of the two is required)")
    rm_mode.add_argument("--quarantined", action="store_true",
                         help=f"delete a quarantined entry ({REJECTED_DIR}/ENTRY), whatever its state")
    for cmd in (prune_cmd, pin, unpin, quarantine_cmd, unquarantine, rm):
        add_root(cmd)
    for cmd in (pin, unpin, quarantine_cmd):
        cmd.add_argument("generation", metavar="GEN", help="generation name (gen-3300 or 3300 too)")
    unquarantine.add_argument("entry", metavar="ENTRY",
                              help=f"a quarantined generation ({REJECTED_DIR}/ENTRY or ENTRY, as ls "
                                   "names it)")
    rm.add_argument("name", metavar="NAME",
                    help=f"generation name, or a quarantined entry ({REJECTED_DIR}/ENTRY or ENTRY)")
    return [prune_cmd, pin, unpin, quarantine_cmd, unquarantine, rm]




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
