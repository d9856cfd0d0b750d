"""Shared objects of incremental generations: how they enter a root's ``objects/`` and how
pruning finds those no generation references any more (mark and sweep).

An attempt writes its new objects below its own pending directory (``.pending-G-A/objects/``,
each file fsynced and named by its digest). Publication (rank 0, or the leader that publishes
a replay) moves them into the root's ``objects/`` after the pending manifest is durable and
before the rename that commits the generation: referenced bytes are durable before the
manifest that references them becomes visible, and a pruning pass that lists ``objects/``
first, then the pending manifests, then the committed ones never misses a reference
(docs/incremental.md, "Why pruning never deletes an object in use"). Torch-free.

Names are digests, so a save may install an object again under the name of one a concurrent
sweep already found unreferenced (the same bytes written anew: a second job from the same
base, a fresh ledger). On a local root the sweep therefore records each listed object's inode
before it reads the manifests, and removes an object by renaming it aside first
(``objects/.swept-<name>.<tag>``): an aside file that is not the inode it judged is a fresh
install, renamed back at once. A sweep killed between the two steps leaves an aside file;
the next sweep puts it back when its name is missing, else deletes it (``recover_aside``).

Second copies (``CheckpointConfig.object_copies``, docs/incremental.md, "A second copy of each
object"): where no mirror keeps another copy, each object an attempt writes gets a second,
separately written file ``objects-copy/<name>`` below the same root (``write_copies``: the
first read back, hashed and checked against its entry on the way), installed with the first,
before the rename. No manifest lists it (the format is unchanged); restore's repair reads it
when the first is damaged or missing (``restore/repair.py``), and the sweep removes it with
the first: a copy is kept exactly while its name is referenced.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from .. import faults, logs
from ..errors import DistCkptError, StorageError
from ..storage.base import Store, StoreReader, read_bounded
from ..storage.local import fsync_dir, makedirs_durable
from .copy import copy_verified, fsynced_file
from .manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OBJECTS_DIR,
    PENDING_PREFIX,
    FileEntry,
    Manifest,
    is_object_path,
    parse_generation,
)
from .quarantine import list_quarantined

log = logs.get(__name__)


class SweepRefused(StorageError):
    """A manifest that could reference objects cannot be read: nothing is swept."""


COPIES_DIR = "objects-copy"  # ROOT/objects-copy/<name>: the second copy of ROOT/objects/<name>


def copy_path(path: str) -> str:
    """Where the second copy of shared object ``path`` (``objects/<name>``) lies below the same
    root: ``objects-copy/<name>``."""
    return f"{COPIES_DIR}/{path.removeprefix(OBJECTS_DIR + '/')}"


def object_of(rel: str) -> str:
    """The object a listed file stands for: ``objects-copy/<name>`` -> ``objects/<name>``."""
    prefix = COPIES_DIR + "/"
    return f"{OBJECTS_DIR}/{rel[len(prefix):]}" if rel.startswith(prefix) else rel


def keeps_copies(root: str) -> bool:
    """Whether a local root keeps second copies of its objects: its ``objects-copy/`` exists.
    For the launcher's persist at breakpoint, which does not see the job's configuration."""
    return os.path.isdir(os.path.join(root, COPIES_DIR))


def write_copies(local_dir: str, entries: list[FileEntry], generation: str, *,
                 open_target: Callable[[str], AbstractContextManager[Any]] = fsynced_file,
                 stop: Callable[[], bool] = lambda: False) -> bool:
    """The second copies of an attempt's new objects (``entries``: their manifest entries):
    each ``local_dir/objects/<name>`` read back and hashed while it is written to
    ``local_dir/objects-copy/<name>`` (fsynced, then the directory) with the same durability
    as the first (``open_target``: the tier's durable sink, past the page cache where the
    first went so; the default keeps this module torch-free for the launcher). Reading the
    first back proves it as well: a mismatch raises ``ValidationError`` and the save fails
    rather than commit a bad object.
    ``stop`` (the commit deadline passed) ends it early and it returns False. On a failure or
    a stop the copies made are removed: they are in no report, nobody else would."""
    made: list[str] = []
    try:
        for entry in entries:
            if stop():
                _unlink_all(made)
                return False
            target = os.path.join(local_dir, copy_path(entry.path))
            made.append(target)
            copy_verified(os.path.join(local_dir, entry.path), target, entry, generation,
                          open_target=open_target)
        if made:
            fsync_dir(os.path.join(local_dir, COPIES_DIR))
    except BaseException:
        _unlink_all(made)
        raise
    return True


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def install_objects(pending: str, root: str) -> list[str]:
    """Move the objects below ``pending/objects/`` into ``root/objects/`` (a name that is
    there already is replaced: the same digest, so the same bytes, freshly written), then
    their second copies below ``pending/objects-copy/`` into ``root/objects-copy/``; each
    directory is fsynced. Returns the objects moved (``objects/<name>``)."""
    moved = _install(pending, root, OBJECTS_DIR, "commit.object_installed")
    _install(pending, root, COPIES_DIR, None)  # before the rename too: no committed object lacks it
    return moved


def _install(pending: str, root: str, folder: str, point: str | None) -> list[str]:
    source = os.path.join(pending, folder)
    try:
        names = sorted(os.listdir(source))
    except FileNotFoundError:
        return []
    moved = [f"{folder}/{name}" for name in names if is_object_path(f"{OBJECTS_DIR}/{name}")]
    if not moved:
        return []
    target = os.path.join(root, folder)
    makedirs_durable(target)  # a new objects/ entry itself is durable, not only its contents
    for path in moved:
        os.replace(os.path.join(pending, path), os.path.join(root, path))
        if point is not None:
            faults.hit(point, 0)
    fsync_dir(target)
    # the names left the pending directory: durably so, or a power cut could bring them back
    # inside the committed generation's directory
    fsync_dir(source)
    return moved


def holds_object(store: StoreReader, entry: FileEntry) -> bool:
    """Whether ``store`` holds the shared object ``entry`` names (``objects/<name>`` below its
    root) with the listed size, as a regular file reached without links: a replay copies or
    uploads an object only where this is False, and publishes only where it is True for every
    object listed. Its digest is not read: a damaged copy is what validation and repair find."""
    try:
        return store.checked_size(entry.path) == entry.size
    except (OSError, DistCkptError):  # missing, a link, not a regular file, unreadable
        return False


def listed_objects(store: StoreReader, folder: str = OBJECTS_DIR) -> list[str]:
    """The shared objects below the root (``objects/<name>``; with ``folder=COPIES_DIR`` their
    second copies, ``objects-copy/<name>``); none when the folder is not there."""
    try:
        names = store.listdir(folder)
    except (FileNotFoundError, StorageError):
        return []
    return [f"{folder}/{n}" for n in names if is_object_path(f"{OBJECTS_DIR}/{n}")]


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
    then the generations' (an attempt that commits meanwhile is seen as one or the other), with
    the quarantined generations' read before and after them (one quarantined or put back
    meanwhile is seen in one place or the other). ``dropping``: generations and quarantined
    entries (``rejected/<entry>``) about to be deleted, whose references do not count."""
    refs = _quarantined_references(store, dropping)
    for name in store.listdir(""):
        if name.startswith(PENDING_PREFIX):
            refs |= _references(store, f"{name}/{MANIFEST_NAME}")
    for name in store.listdir(""):
        if parse_generation(name) is not None and name not in dropping:
            refs |= _references(store, f"{name}/{MANIFEST_NAME}")
    return refs | _quarantined_references(store, dropping)


def _quarantined_references(store: StoreReader, dropping: frozenset[str]) -> set[str]:
    """Objects listed by quarantined generations (``rejected/``): kept with them, for whoever
    examines why they were rejected or puts one back (``dist-ckpt rm`` of the entry, or a
    prune of it, releases them). A rejected manifest that does not parse references nothing:
    it is often the damage. A files entry has no manifest (its objects are damaged copies)."""
    refs: set[str] = set()
    for entry in list_quarantined(store):
        if entry.kind != "generation" or entry.path in dropping:
            continue
        try:
            refs |= _references(store, f"{entry.path}/{MANIFEST_NAME}")
        except SweepRefused:
            continue
    return refs


ASIDE_PREFIX = ".swept-"  # objects/.swept-<name>.<tag>: an object a sweep is removing


@dataclass(frozen=True)
class Candidate:
    """An object the sweep found unreferenced, with the identity (device, inode) it had when
    it was listed, before the manifests were read; None where the store has no inodes."""

    path: str  # objects/<name>
    identity: tuple[int, int] | None


def _local_path(store: StoreReader, rel: str) -> str | None:
    """Where ``rel`` lies on this machine's filesystem, for a store that has one (which
    has inodes); None for an object store."""
    return store.local_path(rel)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def sweep_candidates(store: StoreReader, *, dropping: frozenset[str] = frozenset()) -> list[Candidate]:
    """The sweep's list: objects listed (and, on a local root, their inodes taken) first, then
    the references read: an object installed after that is not in the list, and one installed
    before has its manifest readable by then (``install_objects`` runs after the pending
    manifest is durable, before the rename). Raises ``SweepRefused`` when a manifest cannot be
    read."""
    listed = listed_objects(store) + listed_objects(store, COPIES_DIR)  # a copy goes with its object
    if not listed:
        return []
    identities: dict[str, tuple[int, int] | None] = {}
    for rel in listed:
        local = _local_path(store, rel)
        identity = _identity(local) if local is not None else None
        if local is not None and identity is None:
            continue  # gone since the listing (another sweep)
        identities[rel] = identity
    refs = referenced_objects(store, dropping=dropping)
    return [Candidate(rel, identity) for rel, identity in identities.items() if object_of(rel) not in refs]


def remove_object(store: Store, candidate: Candidate) -> bool:
    """Remove one object :func:`sweep_candidates` listed (the sweeping process, after the
    listing). On a local root the object is renamed aside, and deleted only when the aside file
    is the inode that was judged unreferenced; a different inode was installed again by a save
    after the listing and goes straight back. Returns whether the object was deleted."""
    local = _local_path(store, candidate.path)
    if local is None or candidate.identity is None:
        store.remove_tree(candidate.path)
        return True
    folder, name = os.path.split(local)
    aside = os.path.join(folder, f"{ASIDE_PREFIX}{name}.{uuid.uuid4().hex[:8]}")
    try:
        os.rename(local, aside)
    except FileNotFoundError:
        return False  # another sweep removed it
    faults.hit("prune.object_aside")
    try:
        same = _identity(aside) == candidate.identity
        if not same:  # a save installed it again after the listing: it may be referenced now
            os.rename(aside, local)  # the same bytes (one digest, one name) as a fresher copy
            log.info("%s was installed again during the sweep; kept", store.url(candidate.path))
            return False
        os.unlink(aside)
    except FileNotFoundError:
        return False  # another sweep's recovery took the aside file first: nothing lost
    return True


def recover_aside(store: Store) -> int:
    """A sweep killed after renaming an object (or its second copy) aside: put each aside file
    back where its name is missing (the sweep about to run judges it again), delete the rest
    (its name holds the same bytes). Call before :func:`sweep_candidates`; local roots only.
    Returns the files put back."""
    restored = 0
    for rel in (OBJECTS_DIR, COPIES_DIR):
        folder = _local_path(store, rel)
        if folder is None:
            return 0
        restored += _recover_in(folder)
    return restored


def _recover_in(folder: str) -> int:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    restored = 0
    for aside in names:
        original = aside[len(ASIDE_PREFIX):].rsplit(".", 1)[0]
        if not aside.startswith(ASIDE_PREFIX) or not is_object_path(f"{OBJECTS_DIR}/{original}"):
            continue
        source, target = os.path.join(folder, aside), os.path.join(folder, original)
        try:
            if os.path.exists(target):
                os.unlink(source)
            else:
                os.rename(source, target)
                restored += 1
        except FileNotFoundError:
            continue  # a concurrent sweep took it
    return restored
