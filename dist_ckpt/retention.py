"""Retention: a pure policy over generation names, and a separate pruner that deletes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .errors import ValidationError
from .manifest import MANIFEST_NAME, Manifest, parse_generation
from .storage.base import Backend
from .storage.objectstore import ObjectStoreBackend
from .validate import list_generations, read_manifest

log = logging.getLogger(__name__)


def to_drop(names: list[str], *, keep_last: int, pinned: frozenset[str] = frozenset()) -> list[str]:
    """Names to delete: all but the newest ``keep_last`` (by update number) and the pinned."""
    ordered = sorted(names, key=lambda n: parse_generation(n) or 0, reverse=True)
    return [n for n in ordered[keep_last:] if n not in pinned]


def prune(backend: Backend, committed: list[str], *, keep_last: int,
          pinned: frozenset[str] = frozenset(), dry_run: bool = False) -> list[str]:
    """Delete old generations; call only after the newest validated. Failures are logged."""
    dropped = to_drop(committed, keep_last=keep_last, pinned=pinned)
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


def plan_object_store_prune(backend: ObjectStoreBackend, *, keep_last: int | None) -> PrunePlan:
    """Pure listing step: which objects of failed or superseded attempts can go.

    Generations without a manifest that are newer than the newest committed one are left
    alone: they may be uploads in flight.
    """
    plan = PrunePlan()
    committed: list[tuple[str, Manifest]] = []
    incomplete: list[str] = []
    for name in list_generations(backend):
        try:
            committed.append((name, read_manifest(backend, name)))
        except ValidationError:
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
        plan.generations = to_drop([n for n, _ in committed], keep_last=keep_last)
    return plan


def prune_object_store(backend: ObjectStoreBackend, *, keep_last: int | None,
                       dry_run: bool = False) -> PrunePlan:
    """Delete what :func:`plan_object_store_prune` lists and abort their multipart uploads."""
    plan = plan_object_store_prune(backend, keep_last=keep_last)
    if dry_run:
        return plan
    for rel in plan.generations + plan.incomplete + plan.orphans:
        try:
            plan.multipart_aborted += backend.abort_multipart_uploads(rel)
            backend.remove_tree(rel)
        except OSError as exc:
            log.warning("could not prune %s: %s", rel, exc)
    return plan
