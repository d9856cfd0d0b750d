"""Shared objects of incremental generations on a POSIX root: how they enter ``objects/``.

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

from .. import faults
from ..storage.local import fsync_dir
from .manifest import OBJECTS_DIR, is_object_path


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
