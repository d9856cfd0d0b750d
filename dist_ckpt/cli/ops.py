"""``dist-ckpt pin``/``unpin``, ``quarantine``/``unquarantine`` and ``rm``: the commands that
change what is under a root. Quarantine moves a generation aside under ``ROOT/rejected/``;
unquarantine puts one back. Nothing here deletes a generation in the root that validates;
``rm --quarantined`` deletes a quarantined entry whatever its state."""

from __future__ import annotations

import argparse
import json

from ..errors import DistCkptError, GenerationExists, StorageError, ValidationError
from ..format.inventory import GenerationInfo, inspect_generation
from ..format.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    REJECTED_DIR,
    RejectedEntry,
    parse_generation,
    parse_rejected_entry,
    read_latest_name,
)
from ..format.quarantine import EntryView, reason_line
from ..format.signing import key_from_env
from ..format.validate import Problem, move_latest, repoint_latest, validate
from ..lifecycle.retention import change_pin, read_pins
from ..storage.base import Store, StoreReader
from ..tiers import CommitTier, open_tier
from ..tiers.base import PutsBack
from .common import (
    Refused,
    UsageError,
    checked_generation,
    generation_arg,
    open_root,
    open_root_tier,
    reported_here,
    safe_generation_name,
)
from .inspection import verify_result


def cmd_pin(args: argparse.Namespace) -> int:
    store = open_root(args.root)
    if args.command == "unpin":  # a pruned-by-hand generation can still be unpinned
        name = safe_generation_name(args.generation)
        if name not in read_pins(store):
            raise Refused(f"{name} is not pinned")
        change = change_pin(store, name, None)
        message = f"unpinned {name} (was {change.previous})"
    else:
        name = checked_generation(store, args.generation)
        info = inspect_generation(store, name, digests=False, key=key_from_env())
        if info.state != "committed":  # a pin keeps bytes nobody can restore from
            raise Refused(f"cannot pin {name}: {info.reason}")
        change = change_pin(store, name, args.label)
        message = pin_message(name, change.previous, args.label)
    if args.json:
        print(json.dumps({"generation": name, "label": change.pins.get(name),
                          "previous": change.previous, "message": message, "pins": change.pins}))
    else:
        print(f"{message}; {len(change.pins)} pinned generation(s) under {store.root}")
    return 0


def pin_message(name: str, previous: str | None, label: str) -> str:
    if previous is None:
        return f"pinned {name} as {label}"
    if previous == label:
        return f"{name} was already pinned as {label}"
    return f"{name} was pinned as {previous}, now {label}"


def cmd_quarantine(args: argparse.Namespace) -> int:
    tier = open_quarantine_root(args.root, "quarantine")
    store = tier.store
    name = checked_generation(store, args.generation)
    key = key_from_env()
    info = inspect_generation(store, name, digests=False, key=key)
    pins = read_pins(store)
    damage = None if args.force else refuse_quarantine(store, name, info, pins, key)
    reason = args.reason or damage or info.reason or "moved aside by an operator (dist-ckpt quarantine)"
    with reported_here():
        target = tier.move_aside(Problem(name, reason, None if args.reason else info.path))
    if target is None:
        raise UsageError(f"{name} is not a directory under {store.root}")
    unpinned = change_pin(store, name, None).previous if name in pins else None
    pointer = repointed(store, name)
    if args.json:
        print(json.dumps({"generation": name, "path": target, "reason": reason, "unpinned": unpinned,
                          "latest": pointer}))
    else:
        print(f"moved {name} aside to {target}")
        if unpinned is not None:  # a later save of this update number must not inherit the pin
            print(f"unpinned {name} (was {unpinned})")
        if pointer is not None:
            print(pointer_text(pointer))
    return 0


def open_quarantine_root(root: str, command: str) -> CommitTier:
    """quarantine and rm move or delete entries under ``ROOT/rejected/``: only tiers that keep
    rejected generations have one (POSIX roots and object stores)."""
    try:
        keeps_rejected = open_tier(root).keeps_rejected  # no network call for a refusal
    except DistCkptError as exc:
        raise UsageError(f"{command}: cannot open {root!r}: {exc}") from exc
    if not keeps_rejected:
        raise UsageError(f"{command}: {root!r} keeps no rejected generations")
    return open_root_tier(root)


def refuse_quarantine(store: Store, name: str, info: GenerationInfo, pins: dict[str, str],
                      key: bytes | None) -> str | None:
    """Without --force: never move a pinned generation, nor the one latest.json names while it
    validates (digests included: a damaged latest may go). Returns the damage found, if any."""
    if name in pins:
        raise Refused(f"{name} is pinned as {pins[name]}; unpin it or pass --force")
    if info.state != "committed" or name != read_latest_name(store):
        return None
    result = verify_result(store, name, key)
    if result["ok"]:
        raise Refused(f"{name} is the valid generation {LATEST_NAME} points to; pass --force to "
                      f"move it aside anyway")
    return str(result["reason"])


def quarantined_entry(store: Store, name: str) -> RejectedEntry | None:
    """The quarantined entry ``name`` names (``ENTRY`` or ``rejected/ENTRY``, either kind),
    which must exist; None when ``name`` is a generation's name. Anything else (a path,
    traversal, another name) exits 2."""
    if parse_generation(generation_arg(name)) is not None:
        return None
    entry = parse_rejected_entry(name.removeprefix(f"{REJECTED_DIR}/"))
    if entry is None:
        raise UsageError(f"{name!r} is neither a generation name nor a quarantined entry "
                         f"({REJECTED_DIR}/gen-NNNNNNNNNNNN-<time>-<id>, or "
                         f"{REJECTED_DIR}/gen-NNNNNNNNNNNN-files-<time>-<id>)")
    if not holds_anything(store, entry.path):
        raise UsageError(f"no quarantined entry {entry.name!r} under {store.url(REJECTED_DIR)}")
    return entry


def holds_anything(store: StoreReader, rel: str) -> bool:
    """Whether ``rel`` is a directory (an object store: a prefix) that holds something."""
    try:
        return bool(store.listdir(rel))
    except (StorageError, OSError):
        return False


def cmd_rm(args: argparse.Namespace) -> int:
    if not (args.invalid_only or args.quarantined):
        raise UsageError("rm needs --invalid-only: it deletes only a generation that fails "
                         "validation (committed data is never deleted by accident; old "
                         "generations go with `dist-ckpt prune`); or --quarantined for an "
                         f"entry under {REJECTED_DIR}/, deleted whatever its state")
    store = open_quarantine_root(args.root, "rm").store
    entry = quarantined_entry(store, args.name)
    if entry is None and args.quarantined:
        raise UsageError(f"--quarantined deletes an entry under {REJECTED_DIR}/; {args.name!r} is a "
                         "generation in the root (damaged: --invalid-only; old: `dist-ckpt prune`)")
    if entry is None:
        generation = rel = checked_generation(store, args.name)
    else:
        generation, rel = entry.generation, entry.path
    if entry is not None and (args.quarantined or entry.kind == "files"):
        # a files entry holds only copies a repair found damaged: invalid by construction
        reason = f"quarantined: {reason_line(store, entry)}"
    else:  # bytes only: a generation signed under another key is not damaged, and this deletes
        view = store if entry is None else EntryView(store, entry)
        result = verify_result(view, generation, key=None)
        if result["ok"]:
            hint = "" if entry is None else ("; --quarantined deletes it all the same, "
                                             "`dist-ckpt unquarantine` puts it back")
            raise Refused(f"{rel} is valid ({result['reason']}); not deleted{hint}")
        reason = str(result["reason"])
    store.remove_tree(f"{rel}/{MANIFEST_NAME}")  # first: a cut-short delete leaves no manifest
    store.remove_tree(rel)
    if store.exists(rel):
        raise OSError(f"could not delete all of {store.url(rel)}")
    unpinned, pointer = None, None
    if entry is None:
        pointer = repointed(store, generation)
        if generation in read_pins(store):
            unpinned = change_pin(store, generation, None).previous
    if args.json:
        print(json.dumps({"deleted": rel, "path": store.url(rel), "reason": reason,
                          "unpinned": unpinned, "latest": pointer}))
    else:
        print(f"deleted {rel} ({reason})")
        if unpinned is not None:
            print(f"unpinned {generation} (was {unpinned})")
        if pointer is not None:
            print(pointer_text(pointer))
    return 0


def cmd_unquarantine(args: argparse.Namespace) -> int:
    """Put a quarantined generation back: only where no generation of its name is, only if
    it validates (sizes, digests and, with a key, its signature), atomically; latest.json
    moves to it only when it is the newest."""
    tier = open_quarantine_root(args.root, "unquarantine")
    store = tier.store
    entry = quarantined_entry(store, args.entry)
    if entry is None:
        raise UsageError(f"{args.entry!r} is a generation name; unquarantine takes a quarantined "
                         f"entry ({REJECTED_DIR}/ENTRY or ENTRY, as `dist-ckpt ls` lists it)")
    if entry.kind == "files":
        raise Refused(f"{entry.path} holds damaged files that a restore replaced with good copies "
                      f"({entry.generation} itself stayed in place): there is nothing to put back; "
                      f"delete it with `dist-ckpt rm {args.root} {entry.path} --quarantined`")
    if not isinstance(tier, PutsBack):
        raise UsageError(f"unquarantine: {args.root!r} cannot take a generation back")
    key = key_from_env()

    def check(view: StoreReader) -> None:
        try:
            validate(view, entry.generation, digests=True, key=key)
        except (ValidationError, OSError) as exc:
            raise Refused(f"{entry.path} does not validate, not put back: {exc}") from exc

    try:
        with reported_here():
            where = tier.put_back(entry, check)
    except GenerationExists as exc:
        raise Refused(f"{exc}: a quarantined generation is never put back over what holds its "
                      "name (quarantine or remove that first)") from exc
    pointer = advance_latest(store, entry.generation, key)
    if args.json:
        print(json.dumps({"entry": entry.path, "generation": entry.generation, "path": where,
                          "latest": pointer}))
    else:
        print(f"put {entry.path} back as {entry.generation} ({where})")
        if pointer is not None:
            print(pointer_text(pointer))
    return 0


def advance_latest(store: Store, generation: str, key: bytes | None) -> dict[str, str | None] | None:
    """After ``generation`` was put back: ``latest.json`` names it if it is the newest (the
    pointer never moves back to an older one); the change, or None when the pointer stayed."""
    manifest = validate(store, generation, digests=False, key=key)  # in place: structure and sizes
    before = read_latest_name(store)
    move_latest(store, manifest, store.read_bytes(f"{generation}/{MANIFEST_NAME}"))
    now = read_latest_name(store)
    return None if now == before else {"was": before, "now": now}


def repointed(store: Store, gone: str) -> dict[str, str | None] | None:
    """After ``gone`` was deleted or moved aside: a ``latest.json`` that named it names the
    newest generation left that validates (sizes and digests), or is removed (``now`` None).
    None when the pointer named something else (left alone)."""
    if read_latest_name(store) != gone:
        return None
    return {"was": gone, "now": repoint_latest(store, [gone], digests=True, key=key_from_env())}


def pointer_text(change: dict[str, str | None]) -> str:
    if change["now"] is None:
        return f"removed {LATEST_NAME} (it named {change['was']}): no valid generation is left"
    if change["was"] is None:
        return f"{LATEST_NAME} now names {change['now']} (there was none)"
    return f"{LATEST_NAME} now names {change['now']} (it named {change['was']})"
