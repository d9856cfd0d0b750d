"""Retention: a pure policy over generation names, and a separate pruner that deletes.

The policy keeps the newest ``keep_last`` committed generations, every ``keep_every``-th
update (milestones: the update number is a multiple of it) and pinned generations. Pins
live in ``ROOT/pins.json`` (name -> label, written by ``dist-ckpt pin`` or
``CheckpointManager.pin`` on rank 0); the pruner never deletes a pinned generation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import logs
from ..errors import StorageError, ValidationError
from ..format.manifest import MANIFEST_NAME, Manifest, check_generation_name, parse_generation
from ..format.signing import SIGNATURE_NAME
from ..format.validate import list_generations, read_manifest
from ..storage.base import Backend
from ..storage.objectstore import ObjectStoreBackend

log = logs.get(__name__)


PINS_NAME = "pins.json"


def to_drop(names: list[str], *, keep_last: int, pinned: frozenset[str] = frozenset(),
            keep_every: int | None = None) -> list[str]:
    """Names to delete: all but the newest ``keep_last`` (by update number), the milestones
    (update number a multiple of ``keep_every``) and the pinned."""
    ordered = sorted(names, key=lambda n: parse_generation(n) or 0, reverse=True)
    return [n for n in ordered[keep_last:] if n not in pinned
            and not (keep_every and (parse_generation(n) or 0) % keep_every == 0)]


def read_pins(backend: Backend) -> dict[str, str]:
    """Pinned generation -> label; an unreadable pins file pins nothing and says so."""
    try:
        raw = backend.read_bytes(PINS_NAME)
    except (FileNotFoundError, StorageError):
        return {}
    try:
        pins = json.loads(raw)["pins"]
        for name in pins:
            check_generation_name(name)
        return {str(k): str(v) for k, v in pins.items()}
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError) as exc:
        raise StorageError(f"{backend.url(PINS_NAME)} is corrupt: {exc}") from exc


@dataclass(frozen=True)
class PinChange:
    """The pins after a change and the label ``generation`` had before (None: not pinned),
    so that a caller can tell a new pin, a relabel, an unpin and a no-op apart."""

    pins: dict[str, str]
    previous: str | None


def change_pin(backend: Backend, generation: str, label: str | None) -> PinChange:
    """Pin (``label`` given) or unpin (None) ``generation``; ``pins.json`` is rewritten only
    when something changes. Pinning needs a committed generation; unpinning does not (a
    generation deleted by hand can still be unpinned)."""
    check_generation_name(generation)
    pins = read_pins(backend)
    previous = pins.get(generation)
    if label is None:
        pins.pop(generation, None)
    else:
        if not backend.exists(f"{generation}/{MANIFEST_NAME}"):
            raise ValidationError(f"{generation} is not a committed generation under {backend.root}",
                                  generation=generation)
        pins[generation] = label
    if pins.get(generation) != previous:
        write_pins(backend, pins)
    return PinChange(pins, previous)


def set_pin(backend: Backend, generation: str, label: str | None) -> dict[str, str]:
    """Pin (``label`` given) or unpin (None) ``generation``; returns the new pins."""
    return change_pin(backend, generation, label).pins


def write_pins(backend: Backend, pins: dict[str, str]) -> None:
    """Replace the root's ``pins.json``. One writer at a time (rank 0 or an operator's CLI):
    a read-modify-write racing another loses one of the two changes."""
    backend.put_bytes(PINS_NAME, json.dumps({"pins": dict(sorted(pins.items()))}, indent=1).encode())


def prune(backend: Backend, committed: list[str], *, keep_last: int,
          pinned: frozenset[str] = frozenset(), keep_every: int | None = None,
          dry_run: bool = False) -> list[str]:
    """Delete old generations; call only after the newest validated. Failures are logged.
    Generations pinned in the root's ``pins.json`` are kept as well as ``pinned``."""
    pinned = pinned | frozenset(read_pins(backend))
    dropped = to_drop(committed, keep_last=keep_last, pinned=pinned, keep_every=keep_every)
    for name in dropped if not dry_run else []:
        try:
            _remove_generation(backend, name)
        except OSError as exc:
            log.warning("could not prune %s: %s", name, exc)
    return dropped


def _remove_generation(backend: Backend, name: str) -> None:
    """Remove the manifest first: a deletion cut short leaves an uncommitted directory, never
    a committed generation with missing files."""
    try:
        backend.remove_tree(f"{name}/{MANIFEST_NAME}")
    except FileNotFoundError:
        pass
    backend.remove_tree(name)


@dataclass
class PrunePlan:
    """What a prune of an object store removes (or would remove, on a dry run)."""

    generations: list[str] = field(default_factory=list)  # beyond keep_last
    incomplete: list[str] = field(default_factory=list)  # no manifest, older than the newest committed
    orphans: list[str] = field(default_factory=list)  # attempt directories no manifest references
    multipart_aborted: int = 0


def plan_object_store_prune(backend: ObjectStoreBackend, *, keep_last: int | None,
                            keep_every: int | None = None, pinned: frozenset[str] = frozenset(),
                            key: bytes | None = None) -> PrunePlan:
    """Pure listing step: which objects of failed or superseded attempts can go.

    Generations without a manifest that are newer than the newest committed one are left
    alone: they may be uploads in flight. With ``key``, a generation whose signature fails is
    neither counted towards ``keep_last`` nor deleted: forged manifests cannot push real
    generations out.
    """
    plan = PrunePlan()
    committed: list[tuple[str, Manifest]] = []
    incomplete: list[str] = []
    for name in list_generations(backend):
        try:
            committed.append((name, read_manifest(backend, name, key=key)))
        except ValidationError as exc:
            if exc.path != SIGNATURE_NAME:
                incomplete.append(name)
    if not committed:
        return plan
    newest = max(parse_generation(n) or 0 for n, _ in committed)
    plan.incomplete = [n for n in incomplete if (parse_generation(n) or 0) < newest]
    for name, manifest in committed:
        keep = {MANIFEST_NAME, manifest.data_dir.split("/")[0]} if manifest.data_dir else None
        if keep is None:
            continue
        plan.orphans += [f"{name}/{child}" for child in backend.listdir(name) if child not in keep]
    if keep_last is not None:
        plan.generations = to_drop([n for n, _ in committed], keep_last=keep_last,
                                   keep_every=keep_every, pinned=pinned | frozenset(read_pins(backend)))
    return plan


def prune_object_store(backend: ObjectStoreBackend, *, keep_last: int | None,
                       keep_every: int | None = None, pinned: frozenset[str] = frozenset(),
                       key: bytes | None = None, dry_run: bool = False) -> PrunePlan:
    """Delete what :func:`plan_object_store_prune` lists and abort their multipart uploads."""
    plan = plan_object_store_prune(backend, keep_last=keep_last, keep_every=keep_every,
                                   pinned=pinned, key=key)
    if dry_run:
        return plan
    for rel in plan.generations + plan.incomplete + plan.orphans:
        try:
            plan.multipart_aborted += backend.abort_multipart_uploads(rel)
            backend.remove_tree(rel)
        except OSError as exc:
            log.warning("could not prune %s: %s", rel, exc)
    return plan
