"""Shared objects of incremental generations: how they enter a root's ``objects/`` and how
pruning finds those no generation references any more (mark and sweep).

An attempt writes its new objects below its own pending directory (``.pending-G-A/objects/``,
each file fsynced and named by its digest). Publication (rank 0, or the leader that publishes
a replay) moves them into the root's ``objects/`` after the pending manifest is durable and
before the rename that commits the generation: referenced bytes are durable before the
manifest that references them becomes visible, and a pruning pass that lists ``objects/``
first, then the pending manifests, then the committed ones never misses a reference
(docs/incremental.md, "Why pruning never deletes an object in use"). Torch-free.
"""

from __future__ import annotations

import os

from pydantic import ValidationError as PydanticValidationError

from .. import faults, logs
from ..errors import StorageError
from ..storage.base import StoreReader, read_bounded
from ..storage.local import fsync_dir
from .manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OBJECTS_DIR,
    PENDING_PREFIX,
    Manifest,
    is_object_path,
    parse_generation,
)

log = logs.get(__name__)


class SweepRefused(StorageError):
    """A manifest that could reference objects cannot be read: nothing is swept."""


def install_objects(pending: str, root: str) -> list[str]:
    """Move the objects below ``pending/objects/`` into ``root/objects/`` (a name that is
    there already is replaced: the same digest, so the same bytes, freshly written); the
    directory is fsynced. Returns the paths moved (``objects/<name>``)."""
    source = os.path.join(pending, OBJECTS_DIR)
    try:
        names = sorted(os.listdir(source))
    except FileNotFoundError:
        return []
    moved = [f"{OBJECTS_DIR}/{name}" for name in names if is_object_path(f"{OBJECTS_DIR}/{name}")]
    if not moved:
        return []
    target = os.path.join(root, OBJECTS_DIR)
    os.makedirs(target, exist_ok=True)
    for path in moved:
        os.replace(os.path.join(pending, path), os.path.join(root, path))
        faults.hit("commit.object_installed", 0)
    fsync_dir(target)
    fsync_dir(pending)
    return moved


def listed_objects(store: StoreReader) -> list[str]:
    """The shared objects below the root (``objects/<name>``); none when there is no
    ``objects/``."""
    try:
        names = store.listdir(OBJECTS_DIR)
    except (FileNotFoundError, StorageError):
        return []
    return [f"{OBJECTS_DIR}/{n}" for n in names if is_object_path(f"{OBJECTS_DIR}/{n}")]


def _references(store: StoreReader, rel: str) -> set[str]:
    """The objects the manifest at ``rel`` lists; none when it is not there (any more)."""
    try:
        raw = read_bounded(store, rel, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return set()
    except (OSError, StorageError) as exc:
        if not store.exists(rel):
            return set()
        raise SweepRefused(f"cannot read {store.url(rel)}: {exc}") from exc
    try:
        manifest = Manifest.model_validate_json(raw)
    except (ValueError, TypeError, RecursionError, PydanticValidationError) as exc:
        raise SweepRefused(f"{store.url(rel)} does not parse: objects it may reference are kept") from exc
    return {f.path for f in manifest.objects}


def referenced_objects(store: StoreReader, *, dropping: frozenset[str] = frozenset()) -> set[str]:
    """Every object a manifest under the root references: pending attempts' manifests first,
    then the generations' (an attempt that commits meanwhile is seen as one or the other).
    ``dropping``: generations about to be deleted, whose references do not count."""
    refs: set[str] = set()
    for name in store.listdir(""):
        if name.startswith(PENDING_PREFIX):
            refs |= _references(store, f"{name}/{MANIFEST_NAME}")
    for name in store.listdir(""):
        if parse_generation(name) is not None and name not in dropping:
            refs |= _references(store, f"{name}/{MANIFEST_NAME}")
    return refs


def unreferenced_objects(store: StoreReader, *, dropping: frozenset[str] = frozenset()) -> list[str]:
    """The sweep's list: objects listed first, then the references read (an object installed
    after the listing is not in it; one installed before has its manifest readable by then:
    ``install_objects``). Raises ``SweepRefused`` when a manifest cannot be read."""
    listed = listed_objects(store)
    if not listed:
        return []
    refs = referenced_objects(store, dropping=dropping)
    return [path for path in listed if path not in refs]
