"""Retention: a pure policy over generation names, and a separate pruner that deletes.

The policy keeps the newest ``keep_last`` committed generations, every ``keep_every``-th
update (milestones: the update number is a multiple of it) and pinned generations. Pins
live in ``ROOT/pins.json`` (name -> label, written by ``dist-ckpt pin`` or
``CheckpointManager.pin`` on rank 0); the pruner never deletes a pinned generation.
Quarantined entries (``rejected/``) go only when asked, by age (``dist-ckpt prune
--quarantined-older-than``); a job's own passes never remove them.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import faults, logs
from ..errors import StorageError, ValidationError
from ..format.manifest import (
    MANIFEST_NAME,
    Manifest,
    check_generation_name,
    is_object_path,
    parse_generation,
    pending_dir_name,
)
from ..format.objects import Candidate, recover_aside, remove_object, sweep_candidates
from ..format.quarantine import list_quarantined
from ..format.signing import SIGNATURE_NAME
from ..format.validate import list_generations, read_manifest
from ..protocol.comm import Comm
from ..protocol.messages import PINS_KEY
from ..storage.base import Store, read_bounded
from ..tiers.base import CommitTier

log = logs.get(__name__)


PINS_NAME = "pins.json"


def to_drop(names: list[str], *, keep_last: int, pinned: frozenset[str] = frozenset(),
            keep_every: int | None = None) -> list[str]:
    """Names to delete: all but the newest ``keep_last`` (by update number), the milestones
    (update number a multiple of ``keep_every``) and the pinned."""
    ordered = sorted(names, key=lambda n: parse_generation(n) or 0, reverse=True)
    return [n for n in ordered[keep_last:] if n not in pinned
            and not (keep_every and (parse_generation(n) or 0) % keep_every == 0)]


def read_pins(store: Store) -> dict[str, str]:
    """Pinned generation -> label; an unreadable pins file pins nothing and says so
    (``StorageError``, whatever the bytes: a FIFO or link is refused unopened, deep nesting,
    non-UTF-8 bytes and wrong JSON types are corrupt)."""
    max_bytes = 16 << 20  # a pin is ~50 bytes: far more pins than any root holds generations
    try:
        raw = read_bounded(store, PINS_NAME, max_bytes)  # a FIFO would block a plain read
    except (FileNotFoundError, StorageError):
        return {}
    except ValidationError as exc:
        raise StorageError(f"{store.url(PINS_NAME)} is corrupt: {exc}") from exc
    try:
        pins = json.loads(raw)["pins"]  # non-UTF-8 bytes: UnicodeDecodeError, a ValueError
        if not isinstance(pins, dict):
            raise TypeError(f"'pins' is a {type(pins).__name__}, not an object")
        for name, label in pins.items():
            check_generation_name(name)
            if not isinstance(label, str | int | float | bool):
                raise TypeError(f"the label of {name} is a {type(label).__name__}, not a string")
            str(label).encode("utf-8")  # a lone surrogate (\ud800) could not even be printed
        return {str(k): str(v) for k, v in pins.items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, ValidationError) as exc:
        # RecursionError: deeply nested JSON (json.loads recurses once per level)
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise StorageError(f"{store.url(PINS_NAME)} is corrupt: {why}") from exc


@dataclass(frozen=True)
class PinChange:
    """The pins after a change and the label ``generation`` had before (None: not pinned),
    so that a caller can tell a new pin, a relabel, an unpin and a no-op apart."""

    pins: dict[str, str]
    previous: str | None


def change_pin(store: Store, generation: str, label: str | None) -> PinChange:
    """Pin (``label`` given) or unpin (None) ``generation``; ``pins.json`` is rewritten only
    when something changes. Pinning needs a committed generation; unpinning does not (a
    generation deleted by hand can still be unpinned)."""
    check_generation_name(generation)
    pins = read_pins(store)
    previous = pins.get(generation)
    if label is None:
        pins.pop(generation, None)
    else:
        if not store.exists(f"{generation}/{MANIFEST_NAME}"):
            raise ValidationError(f"{generation} is not a committed generation under {store.root}",
                                  generation=generation)
        pins[generation] = label
    if pins.get(generation) != previous:
        write_pins(store, pins)
    return PinChange(pins, previous)


def set_pin(store: Store, generation: str, label: str | None) -> dict[str, str]:
    """Pin (``label`` given) or unpin (None) ``generation``; returns the new pins."""
    return change_pin(store, generation, label).pins


def write_pins(store: Store, pins: dict[str, str]) -> None:
    """Replace the root's ``pins.json``. One writer at a time (rank 0 or an operator's CLI):
    a read-modify-write racing another loses one of the two changes."""
    store.put_bytes(PINS_NAME, json.dumps({"pins": dict(sorted(pins.items()))}, indent=1).encode())


@dataclass
class Removals:
    """What a prune removes (or would remove, on a dry run)."""

    generations: list[str] = field(default_factory=list)  # beyond keep_last
    incomplete: list[str] = field(default_factory=list)  # no manifest, older than the newest committed
    orphans: list[str] = field(default_factory=list)  # attempt directories no manifest references
    objects: list[str] = field(default_factory=list)  # shared objects no kept generation references
    object_copies: list[str] = field(default_factory=list)  # their second copies (objects-copy/)
    multipart_aborted: int = 0
    quarantined: list[str] = field(default_factory=list)  # entries under rejected/ past their age


def pin_on_all_ranks(comm: Comm, store: Store, mirror: Store | None, generation: str,
                     label: str | None) -> dict[str, str]:
    """``CheckpointManager.pin`` (all ranks, collective): rank 0 changes the pins (in the
    mirror too, so that a prune of the mirror alone keeps them) and publishes them to the
    leaders of other nodes; every rank returns the new pins or raises the same error."""
    outcome: tuple[dict[str, str] | None, str | None] = (None, None)
    if comm.rank == 0:
        try:
            pins = set_pin(store, generation, label)
            if mirror is not None:
                write_pins(mirror, pins)
            comm.publish_names(PINS_KEY, pins)
            outcome = (pins, None)
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the broadcast
            outcome = (None, f"{type(exc).__name__}: {exc}")
    pins, problem = comm.broadcast(outcome)
    if problem is not None:
        raise ValidationError(f"cannot change the pin of {generation}: {problem}", generation=generation)
    return pins


def list_removals(tier: CommitTier, *, keep_last: int | None, keep_every: int | None = None,
                  pinned: frozenset[str] = frozenset(), key: bytes | None = None,
                  committed: list[str] | None = None,
                  quarantined_before: float | None = None) -> Removals:
    """Pure listing step: old generations beyond the policy, the tier's debris of failed
    attempts (``CommitTier.debris``) and, with ``quarantined_before`` (a UNIX time), the
    entries under ``rejected/`` quarantined before it (both kinds; the time in the name).
    ``committed`` (names that validated, newest first) defaults to the generations whose
    manifest parses. With ``key``, a generation whose
    signature fails is neither counted towards ``keep_last`` nor deleted: forged manifests
    cannot push real generations out. Pins in the root's ``pins.json`` are kept as well as
    ``pinned``."""
    removals = Removals()
    manifests: dict[str, Manifest] = {}
    uncommitted: list[str] = []
    for name in list_generations(tier.store):
        try:
            manifests[name] = read_manifest(tier.store, name, key=key)
        except ValidationError as exc:
            if exc.path != SIGNATURE_NAME:
                uncommitted.append(name)
    names = list(manifests) if committed is None else [n for n in committed if n in manifests]
    debris = tier.debris({n: manifests[n] for n in names}, uncommitted)
    removals.incomplete = [d for d in debris if "/" not in d]
    removals.orphans = [d for d in debris if "/" in d]
    if keep_last is not None:
        removals.generations = to_drop(names, keep_last=keep_last, keep_every=keep_every,
                                       pinned=pinned | frozenset(read_pins(tier.store)))
    if quarantined_before is not None:
        removals.quarantined = [entry.path for entry in list_quarantined(tier.store)
                                if entry.time < quarantined_before]
    return removals


def prune(tier: CommitTier, *, keep_last: int | None, keep_every: int | None = None,
          pinned: frozenset[str] = frozenset(), key: bytes | None = None,
          committed: list[str] | None = None, dry_run: bool = False,
          defer: Callable[[Callable[[], None]], Any] | None = None,
          quarantined_before: float | None = None) -> Removals:
    """Delete what :func:`list_removals` lists (call only after the newest generation validated);
    a deletion that fails is logged and the rest go on. Then the sweep: the shared objects no
    manifest under the root references any more (mark and sweep, ``format/objects.py``), and
    their second copies (``objects-copy/``, reported in ``object_copies``).

    Order, each step safe to die after: each generation's manifest, then its files
    (``prune.manifest_removed``, ``prune.between``); only then the sweep, which lists the
    objects, reads every manifest still there (pending attempts' too), then removes the
    objects none lists (``prune.objects_listed``, ``prune.object_aside``,
    ``prune.object_removed``). A kill before the sweep leaves unreferenced objects the next
    prune removes; a kill inside it leaves at most one aside file, which the next sweep puts
    back or deletes. ``dry_run``: ``objects`` lists what the sweep would remove once the
    listed generations are gone; nothing is touched. ``defer`` (a job's pruner): on a local
    root, a generation whose manifest is gone is renamed to a pending name at once (it is no
    generation any more) and ``defer`` gets the deletion of its files, so the caller need not
    wait for it; a crash before that deletion leaves a pending directory, which the next
    start removes like any other."""
    removals = list_removals(tier, keep_last=keep_last, keep_every=keep_every, pinned=pinned, key=key,
                             committed=committed, quarantined_before=quarantined_before)
    if dry_run:
        dropping = frozenset(removals.generations + removals.incomplete + removals.quarantined)
        for candidate in _sweep_candidates(tier, dropping):
            _swept_list(removals, candidate.path).append(candidate.path)
        return removals
    for rel in removals.generations + removals.incomplete + removals.orphans + removals.quarantined:
        try:
            removals.multipart_aborted += tier.store.abort_uploads(rel)
            _remove(tier.store, rel, defer)
            faults.hit("prune.between")
        except OSError as exc:
            log.warning("could not prune %s: %s", rel, exc)
    # the sweep only after the generations went: a manifest still there keeps its objects,
    # and a kill in between leaves unreferenced objects for the next sweep, never the reverse
    try:
        recover_aside(tier.store)
    except OSError as exc:
        log.warning("shared objects under %s not swept: %s", tier.url, exc)
        return removals
    candidates = _sweep_candidates(tier, frozenset())
    faults.hit("prune.objects_listed")
    for candidate in candidates:
        try:
            if remove_object(tier.store, candidate):
                _swept_list(removals, candidate.path).append(candidate.path)
                faults.hit("prune.object_removed")
        except OSError as exc:
            log.warning("could not prune %s: %s", candidate.path, exc)
    return removals


def _swept_list(removals: Removals, path: str) -> list[str]:
    """Where a swept path is reported: an object, or an object's second copy."""
    return removals.objects if is_object_path(path) else removals.object_copies


def _sweep_candidates(tier: CommitTier, dropping: frozenset[str]) -> list[Candidate]:
    try:
        return sweep_candidates(tier.store, dropping=dropping)
    except (StorageError, OSError) as exc:  # SweepRefused among them: keep every object this time
        log.warning("shared objects under %s not swept: %s", tier.url, exc)
        return []


def _remove(store: Store, rel: str, defer: Callable[[Callable[[], None]], Any] | None = None) -> None:
    """Remove a generation's manifest first: a deletion cut short leaves an uncommitted
    directory, never a committed generation with missing files. With ``defer`` on a local
    store the rest is renamed aside and deleted by ``defer``'s thread (deleting a large
    generation's files takes the kernel a while; nobody needs to wait for it)."""
    if "/" not in rel:
        try:
            store.remove_tree(f"{rel}/{MANIFEST_NAME}")
        except FileNotFoundError:
            pass
        faults.hit("prune.manifest_removed")  # half-deleted: no manifest, files remain
        local = store.local_path(rel) if defer is not None else None
        if local is not None:
            aside = pending_dir_name(rel, f"pruned-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(local, store.local_path(aside))
            except FileNotFoundError:
                return
            defer(functools.partial(_remove_quietly, store, aside))
            return
    store.remove_tree(rel)


def _remove_quietly(store: Store, rel: str) -> None:
    try:
        store.remove_tree(rel)
    except OSError as exc:  # a pending directory: the next start removes what is left
        log.warning("could not remove %s: %s", rel, exc)
