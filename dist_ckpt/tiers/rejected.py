"""Moving a rejected generation out of a POSIX root's way, never deleting it.

The rejected directory is renamed to ``ROOT/rejected/<generation>-<UTC time>-<id>/`` with a
``reason.txt`` (both names: ``dist_ckpt.format.manifest``); its bytes are kept as evidence and
nothing reads it as a generation again.
Who calls it and when: ``dist_ckpt.restore.quarantine`` (restore) and ``dist-ckpt quarantine``.
A damaged file that restore replaced with a good copy of the same save goes to
``ROOT/rejected/<generation>-files-<UTC time>-<id>/<path>`` with its ``reason.txt``
(``replace_file``, called by ``dist_ckpt.restore.repair``); its generation stays in place.
A damaged shared object (``ROOT/objects/<name>``, referenced by several generations) is
replaced where it lies and kept as ``.../<generation>-files-.../objects/<name>``.
An object store builds the same entry by copying: ``dist_ckpt.tiers.rejected_store``.
``put_back`` is the way back for a quarantined generation (``dist-ckpt unquarantine``): one
rename, never over anything that holds the name.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

from .. import logs
from ..errors import GenerationExists, UnsafeFileError
from ..format.manifest import (
    REASON_NAME,
    REJECTED_DIR,
    RejectedEntry,
    is_object_path,
    parse_generation,
    rejected_entry_name,
    rejected_files_entry_name,
)
from ..format.quarantine import EntryView
from ..format.validate import Problem
from ..storage.base import StoreReader
from ..storage.local import LocalStore, fsync_dir, write_durable

log = logs.get(__name__)


def move_aside(root: str, problem: Problem) -> str | None:
    """Move ``root/<generation>`` aside; returns where it went (None when absent here)."""
    source = os.path.join(root, problem.generation)
    if parse_generation(problem.generation) is None or not os.path.isdir(source):
        return None
    target_dir = os.path.join(root, REJECTED_DIR)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, rejected_entry_name(problem.generation))
    os.rename(source, target)
    write_durable(os.path.join(target, REASON_NAME), f"{problem}\n".encode())
    fsync_dir(target)
    fsync_dir(target_dir)
    fsync_dir(root)
    log.warning("moved rejected generation %s aside to %s", problem.generation, target)
    return target


def put_back(store: LocalStore, entry: RejectedEntry, check: Callable[[StoreReader], Any]) -> str:
    """Rename quarantined generation ``entry`` back to ``ROOT/<generation>`` once ``check``
    passed on it in its entry (the rename moves those very bytes): the generation appears whole
    or not at all. ``GenerationExists`` when the name is taken, whatever holds it (a rename
    never replaces a directory that holds anything). Its ``reason.txt`` goes after the rename
    (a crash in between leaves that one extra file, which no manifest lists)."""
    root = store.root
    source = os.path.join(root, entry.path)
    target = os.path.join(root, entry.generation)
    taken = GenerationExists(f"{entry.generation} already exists under {root}")
    if os.path.lexists(target):
        raise taken
    check(EntryView(store, entry))
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):  # saved or put back meanwhile
            raise taken from exc
        raise
    fsync_dir(root)
    fsync_dir(os.path.dirname(source))
    try:
        os.unlink(os.path.join(target, REASON_NAME))
    except FileNotFoundError:
        pass
    fsync_dir(target)
    log.info("put quarantined %s back as %s", source, target)
    return target


def replace_file(root: str, generation: str, rel: str, fresh: str | None, reason: str) -> str | None:
    """Install ``fresh`` as ``root/<generation>/<rel>`` (a rename: ``fresh`` is on the same
    filesystem), moving the file it replaces aside first; returns the entry that holds the
    damaged copy, or None when there was none (a missing file). A shared object (``rel`` is
    ``objects/<name>``) is installed at ``root/objects/<name>``, where every generation that
    references it reads it; its damaged copy goes to the same kind of entry, named after
    ``generation`` (the one whose restore found it), as ``<entry>/objects/<name>``.
    ``fresh`` None: the damaged copy is only moved aside (a shared object no tier holds a
    good copy of: a later save or replay then writes it again instead of referencing it)."""
    shared = is_object_path(rel)
    shown = rel if shared else f"{generation}/{rel}"
    base = root if shared else os.path.join(root, generation)
    target = os.path.join(base, rel)
    directory = base
    for part in [""] + rel.split("/")[:-1]:  # never written through a link out of the root
        directory = os.path.join(directory, part) if part else directory
        if os.path.islink(directory):
            raise UnsafeFileError(f"{generation}: {directory} is a symbolic link; {rel} not replaced",
                                  generation=generation, path=rel)
    kept = None
    if os.path.lexists(target):
        rejected_dir = os.path.join(root, REJECTED_DIR)
        kept = os.path.join(rejected_dir, rejected_files_entry_name(generation))
        os.makedirs(os.path.dirname(os.path.join(kept, rel)), exist_ok=True)
        os.rename(target, os.path.join(kept, rel))
        write_durable(os.path.join(kept, REASON_NAME), f"{shown}: {reason}\n".encode())
        fsync_dir(kept)
        fsync_dir(rejected_dir)
    if fresh is None:
        if kept is not None:
            fsync_dir(os.path.dirname(target))
            log.warning("moved the damaged %s aside to %s", shown, kept)
        return kept
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(fresh, target)
    fsync_dir(os.path.dirname(target))
    log.warning("replaced %s with a verified copy%s", shown,
                f"; the damaged one is in {kept}" if kept else "")
    return kept
