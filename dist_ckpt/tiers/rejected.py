"""Moving a rejected generation out of a POSIX root's way, never deleting it.

The rejected directory is renamed to ``ROOT/rejected/<generation>-<UTC time>-<id>/`` with a
``reason.txt``; its bytes are kept as evidence and nothing reads it as a generation again.
Who calls it and when: ``dist_ckpt.restore.quarantine`` (restore) and ``dist-ckpt quarantine``.
"""

from __future__ import annotations

import os
import time
import uuid

from .. import logs
from ..format.manifest import parse_generation
from ..format.validate import Problem
from ..storage.local import fsync_dir, write_durable

log = logs.get(__name__)
REJECTED_DIR = "rejected"
REASON_NAME = "reason.txt"


def move_aside(root: str, problem: Problem) -> str | None:
    """Move ``root/<generation>`` aside; returns where it went (None when absent here)."""
    source = os.path.join(root, problem.generation)
    if parse_generation(problem.generation) is None or not os.path.isdir(source):
        return None
    target_dir = os.path.join(root, REJECTED_DIR)
    os.makedirs(target_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(target_dir, f"{problem.generation}-{stamp}-{uuid.uuid4().hex[:6]}")
    os.rename(source, target)
    write_durable(os.path.join(target, REASON_NAME), f"{problem}\n".encode())
    fsync_dir(target)
    fsync_dir(target_dir)
    fsync_dir(root)
    log.warning("moved rejected generation %s aside to %s", problem.generation, target)
    return target
