"""Moving a rejected generation out of the job's way, never deleting it.

When restore rejects a generation newer than the one it loads (a damaged shard, or a
node-local copy whose other shards never reached the mirror before a crash), the job will
reach that update number again and must be able to save it. The rejected directory is
renamed to ``ROOT/rejected/<generation>-<UTC time>-<id>/`` with a ``reason.txt``; its bytes
are kept as evidence and nothing reads it as a generation again.

Call order: after ``select_generation`` (whose rejections every rank agrees on), the leader of
each filesystem group moves its own copies; the caller then synchronises all ranks.
"""

from __future__ import annotations

import os
import time
import uuid

from .. import logs
from ..format.manifest import parse_generation
from ..format.validate import Problem
from ..protocol.comm import Comm
from ..storage.local import fsync_dir, write_durable

log = logs.get(__name__)
REJECTED_DIR = "rejected"
REASON_NAME = "reason.txt"


def blocking(rejected: list[Problem], chosen: str | None, tier_root: str) -> list[Problem]:
    """The rejections in ``tier_root`` that would block a later save: newer than ``chosen``,
    and rejected for their bytes (a signature under another key is not damage)."""
    floor = -1 if chosen is None else (parse_generation(chosen) or -1)
    return [p for p in rejected if p.tier == tier_root and not p.signature
            and (parse_generation(p.generation) or -1) > floor]


def quarantine(root: str, problem: Problem) -> str | None:
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


def move_blocking(comm: Comm, root: str, rejected: list[Problem], chosen: str | None) -> list[str]:
    """All ranks: each filesystem leader moves its copies of the blocking rejections aside;
    returns the moved generation names (agreed). A move that fails is logged, not raised:
    the save of that update number then fails with ``GenerationExists`` instead."""
    moving = blocking(rejected, chosen, root)
    if not moving:  # the same agreed inputs on every rank: all skip the all-gather together
        return []
    moved: list[str] = []
    if comm.rank == comm.fs_leader:
        for problem in moving:
            try:
                if quarantine(root, problem) is not None:
                    moved.append(problem.generation)
            except OSError as exc:
                log.error("cannot move rejected generation %s aside: %s", problem.generation, exc)
    return sorted({name for names in comm.all_gather(moved) for name in names})
