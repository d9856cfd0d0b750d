"""Who owns a run's memory directory on this node (``dist_ckpt.launcher_api.memory_dir``).

The node's launcher writes ``owner.json`` (its pid, the process start time, host name and run
id) in its run's directory when it starts, and removes the directory when it stops. At its
start it also removes the directories of runs whose launcher is provably dead
(:func:`remove_stale`). Workers never remove a memory directory.

Call order (the launcher's main thread): ``remove_stale`` then ``claim`` once at launch,
``used_bytes`` after each start, ``remove_run`` when the launcher stops.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from typing import Any

from dist_ckpt.launcher_api import MEMORY_DIR_PREFIX, atomic_write, memory_base_dir, memory_dir

log = logging.getLogger(__name__)

OWNER_NAME = "owner.json"
MAX_SCANNED = 1000  # entries of the base directory looked at per start: bounded work


def _start_ticks(pid: int) -> int | None:
    # field 22 of /proc/PID/stat: tells a reused pid from the launcher that wrote owner.json
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
        return int(text.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def claim(run_id: str, base: str | None = None) -> str:
    """The launcher: create its run's directory and record itself as the owner."""
    directory = memory_dir(run_id, base)
    os.makedirs(directory, exist_ok=True)
    owner = {"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
             "host": socket.gethostname(), "run_id": run_id}
    atomic_write(os.path.join(directory, OWNER_NAME), json.dumps(owner).encode())
    return directory


def _owner(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, OWNER_NAME), encoding="utf-8") as handle:
            owner = json.loads(handle.read(4096))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def stale_reason(directory: str) -> str | None:
    """Why ``directory`` provably belongs to a dead launcher, or None (alive, or unknown: a
    directory without an owner file, or another host's, is never called stale)."""
    owner = _owner(directory)
    if owner is None:
        return None
    if owner.get("host") != socket.gethostname():
        return None  # another host's pids mean nothing here
    pid = owner["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"launcher pid {pid} is gone"
    except PermissionError:
        pass  # alive, another user's
    ticks = owner.get("start_ticks")
    if ticks is not None and _start_ticks(pid) not in (None, ticks):
        return f"launcher pid {pid} was reused by another process"
    return None


def remove_stale(base: str | None = None, *, keep: str | None = None) -> list[str]:
    """The launcher at start: remove the run directories of dead launchers (not ``keep``);
    returns what was removed. Looks at no more than ``MAX_SCANNED`` entries."""
    base = base or memory_base_dir()
    try:
        with os.scandir(base) as entries:
            names = [e.name for _, e in zip(range(MAX_SCANNED), entries, strict=False)
                     if e.name.startswith(MEMORY_DIR_PREFIX) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    removed = []
    for name in names:
        directory = os.path.join(base, name)
        if directory == keep:
            continue
        reason = stale_reason(directory)
        if reason is not None:
            log.info("removing stale in-memory checkpoints %s: %s", directory, reason)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def remove_run(run_id: str, base: str | None = None) -> bool:
    """The launcher when it stops: remove its run's directory; True when it existed."""
    directory = memory_dir(run_id, base)
    if not os.path.lexists(directory):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def used_bytes(run_id: str, base: str | None = None) -> int:
    """Bytes of the files under the run's directory (its share of the node's memory)."""
    total = 0
    for parent, _dirs, files in os.walk(memory_dir(run_id, base)):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass  # removed by a prune while we walk
    return total
