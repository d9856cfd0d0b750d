"""``dist-ckpt pin``/``unpin``, ``quarantine`` and ``rm --invalid-only``: the commands that
change what is under a root. Nothing here deletes a generation that validates."""

from __future__ import annotations

import argparse
import json
import os

from ..errors import DistCkptError, UnsafeNameError
from ..format.manifest import LATEST_NAME, MANIFEST_NAME, check_generation_name, parse_generation
from ..format.signing import key_from_env
from ..format.validate import Problem
from ..ops.inventory import GenerationInfo, inspect_generation
from ..ops.retention import change_pin, read_pins
from ..storage.base import Backend
from ..storage.local import LocalBackend
from ..tiers import open_tier
from ..tiers.quarantine import REJECTED_DIR, move_aside
from .common import (
    QUARANTINED_ENTRY,
    Refused,
    UsageError,
    checked_generation,
    open_root,
    read_latest,
)
from .inspection import verify_result


def cmd_pin(args: argparse.Namespace) -> int:
    backend = open_root(args.root)
    if args.command == "unpin":  # a pruned-by-hand generation can still be unpinned
        name = safe_generation_name(args.generation)
        if name not in read_pins(backend):
            raise Refused(f"{name} is not pinned")
        change = change_pin(backend, name, None)
        message = f"unpinned {name} (was {change.previous})"
    else:
        name = checked_generation(backend, args.generation)
        info = inspect_generation(backend, name, digests=False, key=key_from_env())
        if info.state != "committed":  # a pin keeps bytes nobody can restore from
            raise Refused(f"cannot pin {name}: {info.reason}")
        change = change_pin(backend, name, args.label)
        message = pin_message(name, change.previous, args.label)
    if args.json:
        print(json.dumps({"generation": name, "label": change.pins.get(name),
                          "previous": change.previous, "message": message, "pins": change.pins}))
    else:
        print(f"{message}; {len(change.pins)} pinned generation(s) under {backend.root}")
    return 0


def safe_generation_name(name: str) -> str:
    try:
        check_generation_name(name)
    except UnsafeNameError as exc:
        raise UsageError(str(exc)) from exc
    return name


def pin_message(name: str, previous: str | None, label: str) -> str:
    if previous is None:
        return f"pinned {name} as {label}"
    if previous == label:
        return f"{name} was already pinned as {label}"
    return f"{name} was pinned as {previous}, now {label}"


def cmd_quarantine(args: argparse.Namespace) -> int:
    backend = open_local_root(args.root, "quarantine")
    name = checked_generation(backend, args.generation)
    key = key_from_env()
    info = inspect_generation(backend, name, digests=False, key=key)
    pins = read_pins(backend)
    damage = None if args.force else refuse_quarantine(backend, name, info, pins, key)
    reason = args.reason or damage or info.reason or "moved aside by an operator (dist-ckpt quarantine)"
    target = move_aside(backend.root, Problem(name, reason, None if args.reason else info.path))
    if target is None:
        raise UsageError(f"{name} is not a directory under {backend.root}")
    unpinned = change_pin(backend, name, None).previous if name in pins else None
    if args.json:
        print(json.dumps({"generation": name, "path": target, "reason": reason, "unpinned": unpinned}))
    else:
        print(f"moved {name} aside to {target}")
        if unpinned is not None:  # a later save of this update number must not inherit the pin
            print(f"unpinned {name} (was {unpinned})")
    return 0


def open_local_root(root: str, command: str) -> LocalBackend:
    """quarantine and rm move or delete directories under ``ROOT/rejected/``: only tiers that
    keep rejected generations have one (POSIX roots; object stores are not supported yet)."""
    try:
        keeps_rejected = open_tier(root).keeps_rejected  # no network call for a refusal
    except DistCkptError as exc:
        raise UsageError(f"{command}: cannot open {root!r}: {exc}") from exc
    if not keeps_rejected:
        raise UsageError(f"{command}: object stores are not supported yet (local roots only)")
    return LocalBackend(open_root(root).root)


def refuse_quarantine(backend: Backend, name: str, info: GenerationInfo, pins: dict[str, str],
                      key: bytes | None) -> str | None:
    """Without --force: never move a pinned generation, nor the one latest.json names while it
    validates (digests included: a damaged latest may go). Returns the damage found, if any."""
    if name in pins:
        raise Refused(f"{name} is pinned as {pins[name]}; unpin it or pass --force")
    if info.state != "committed" or name != read_latest(backend):
        return None
    result = verify_result(backend, name, key)
    if result["ok"]:
        raise Refused(f"{name} is the valid generation {LATEST_NAME} points to; pass --force to "
                      f"move it aside anyway")
    return str(result["reason"])


class QuarantinedCopy(LocalBackend):
    """An entry under ``ROOT/rejected/`` seen under its generation's name, so that
    ``validate`` checks it unchanged (its manifest still names the generation)."""

    def __init__(self, entry_path: str, generation: str) -> None:
        super().__init__(entry_path)
        self.generation = generation

    def _path(self, rel: str) -> str:
        first, _, rest = rel.partition("/")
        if first != self.generation:
            raise FileNotFoundError(f"{rel} is not inside {self.generation}")
        return super()._path(rest)


def rm_target(backend: LocalBackend, name: str) -> tuple[str, Backend, str]:
    """(path to delete relative to the root, backend to validate through, generation name) for
    a generation or a quarantined entry (``ENTRY`` or ``rejected/ENTRY``)."""
    if parse_generation(name) is not None:
        return checked_generation(backend, name), backend, name
    entry = name.removeprefix(f"{REJECTED_DIR}/")
    match = QUARANTINED_ENTRY.match(entry)
    if match is None:
        raise UsageError(f"{name!r} is neither a generation name nor a quarantined entry "
                         f"({REJECTED_DIR}/gen-NNNNNNNNNNNN-<time>-<id>)")
    rel = f"{REJECTED_DIR}/{entry}"
    if not os.path.isdir(backend.url(rel)):
        raise UsageError(f"no quarantined entry {entry!r} under {backend.url(REJECTED_DIR)}")
    return rel, QuarantinedCopy(backend.url(rel), match.group(1)), match.group(1)


def cmd_rm(args: argparse.Namespace) -> int:
    if not args.invalid_only:
        raise UsageError("rm needs --invalid-only: it deletes only a generation that fails "
                         "validation (committed data is never deleted by accident; old "
                         "generations go with `dist-ckpt prune`)")
    backend = open_local_root(args.root, "rm")
    rel, view, generation = rm_target(backend, args.name)
    # bytes only: a generation signed under another key is not damaged, and this deletes
    result = verify_result(view, generation, key=None)
    if result["ok"]:
        raise Refused(f"{rel} is valid ({result['reason']}); not deleted")
    backend.remove_tree(f"{rel}/{MANIFEST_NAME}")  # first: a cut-short delete leaves no manifest
    backend.remove_tree(rel)
    if backend.exists(rel):
        raise OSError(f"could not delete all of {backend.url(rel)}")
    unpinned = None
    if rel == generation and generation in read_pins(backend):
        unpinned = change_pin(backend, generation, None).previous
    if args.json:
        print(json.dumps({"deleted": rel, "path": backend.url(rel), "reason": result["reason"],
                          "unpinned": unpinned}))
    else:
        print(f"deleted {rel} ({result['reason']})")
        if unpinned is not None:
            print(f"unpinned {generation} (was {unpinned})")
    return 0
