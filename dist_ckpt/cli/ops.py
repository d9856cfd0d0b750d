"""``dist-ckpt pin``/``unpin``, ``quarantine`` and ``rm --invalid-only``: the commands that
change what is under a root. Nothing here deletes a generation that validates."""

from __future__ import annotations

import argparse
import json
from typing import IO

from ..errors import DistCkptError
from ..format.inventory import GenerationInfo, inspect_generation
from ..format.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    REASON_NAME,
    REJECTED_DIR,
    parse_generation,
    read_latest_name,
    rejected_generation,
)
from ..format.signing import key_from_env
from ..format.validate import Problem, repoint_latest
from ..lifecycle.retention import change_pin, read_pins
from ..storage.base import Store, StoreReader
from ..tiers import CommitTier, open_tier
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


class QuarantinedCopy:
    """An entry under ``ROOT/rejected/`` seen (read-only) under its generation's name, so that
    ``validate`` checks it unchanged (its manifest still names the generation)."""

    def __init__(self, store: Store, entry: str, generation: str) -> None:
        self.store = store
        self.entry = entry
        self.generation = generation
        self.root = store.url(entry)

    def _rel(self, rel: str) -> str:
        first, _, rest = rel.partition("/")
        if first != self.generation:
            raise FileNotFoundError(f"{rel} is not inside {self.generation}")
        return f"{self.entry}/{rest}" if rest else self.entry

    def url(self, rel: str) -> str:
        return self.store.url(self._rel(rel))

    def exists(self, rel: str) -> bool:
        return self.store.exists(self._rel(rel))

    def listdir(self, rel: str) -> list[str]:
        return self.store.listdir(self._rel(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.store.read_bytes(self._rel(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return self.store.open_read(self._rel(rel))

    def size(self, rel: str) -> int:
        return self.store.size(self._rel(rel))

    def checked_size(self, rel: str, *, limit: int | None = None,
                     sound_dirs: set[str] | None = None) -> int:
        return self.store.checked_size(self._rel(rel), limit=limit, sound_dirs=sound_dirs)

    def digest(self, rel: str, algorithm: str) -> str:
        return self.store.digest(self._rel(rel), algorithm)

    def tree_size(self, rel: str) -> int:
        return self.store.tree_size(self._rel(rel))

    def local_path(self, rel: str) -> str | None:
        return self.store.local_path(self._rel(rel))


def rm_target(store: Store, name: str) -> tuple[str, StoreReader, str]:
    """(path to delete relative to the root, store to validate through, generation name) for
    a generation or a quarantined entry (``ENTRY`` or ``rejected/ENTRY``)."""
    if parse_generation(generation_arg(name)) is not None:
        full = checked_generation(store, name)
        return full, store, full
    entry = name.removeprefix(f"{REJECTED_DIR}/")
    generation = rejected_generation(entry)
    if generation is None:
        raise UsageError(f"{name!r} is neither a generation name nor a quarantined entry "
                         f"({REJECTED_DIR}/gen-NNNNNNNNNNNN-<time>-<id>)")
    rel = f"{REJECTED_DIR}/{entry}"
    if not store.exists(f"{rel}/{MANIFEST_NAME}") and not store.exists(f"{rel}/{REASON_NAME}"):
        raise UsageError(f"no quarantined entry {entry!r} under {store.url(REJECTED_DIR)}")
    return rel, QuarantinedCopy(store, rel, generation), generation


def cmd_rm(args: argparse.Namespace) -> int:
    if not args.invalid_only:
        raise UsageError("rm needs --invalid-only: it deletes only a generation that fails "
                         "validation (committed data is never deleted by accident; old "
                         "generations go with `dist-ckpt prune`)")
    store = open_quarantine_root(args.root, "rm").store
    rel, view, generation = rm_target(store, args.name)
    # bytes only: a generation signed under another key is not damaged, and this deletes
    result = verify_result(view, generation, key=None)
    if result["ok"]:
        raise Refused(f"{rel} is valid ({result['reason']}); not deleted")
    store.remove_tree(f"{rel}/{MANIFEST_NAME}")  # first: a cut-short delete leaves no manifest
    store.remove_tree(rel)
    if store.exists(rel):
        raise OSError(f"could not delete all of {store.url(rel)}")
    unpinned, pointer = None, None
    if rel == generation:
        pointer = repointed(store, generation)
        if generation in read_pins(store):
            unpinned = change_pin(store, generation, None).previous
    if args.json:
        print(json.dumps({"deleted": rel, "path": store.url(rel), "reason": result["reason"],
                          "unpinned": unpinned, "latest": pointer}))
    else:
        print(f"deleted {rel} ({result['reason']})")
        if unpinned is not None:
            print(f"unpinned {generation} (was {unpinned})")
        if pointer is not None:
            print(pointer_text(pointer))
    return 0


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
    return f"{LATEST_NAME} now names {change['now']} (it named {change['was']})"
