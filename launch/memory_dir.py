"""Who owns a job's memory directory on this node (``dist_ckpt.launcher_api.memory_dir``).

One owner per directory. The node's launcher claims its job's directory when it starts
(:func:`claim`): it takes ``owner.lock`` with ``flock`` and holds it for its whole life (the
kernel releases it when the launcher dies, however it dies), then records itself in
``owner.json`` (pid, process start time, host, run id, root). The record goes to a temporary
file first and is linked into place, so a reader never sees half of it and two claimers never
both write it. A directory whose lock another process holds has a live owner: the claim fails
(:class:`OwnedElsewhere`) and nothing of the directory changes. A directory whose owner is
provably dead is taken over.

Removal (:meth:`Owned.remove`, and the sweep of dead launchers' directories,
:func:`remove_stale`) renames the directory to ``.dist_ckpt-removing-...`` first and deletes it
after: a half-removed directory never carries a live job's name. The sweep removes only a
directory whose lock it could take and whose recorded launcher is gone (its pid ended, or was
reused): never one that a live launcher owns, never one without an owner record. Workers
never remove a memory directory.

Call order (the launcher's main thread): ``remove_stale`` then ``claim`` once at launch,
``Owned.used_bytes`` after each start, ``Owned.remove`` when the launcher stops.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from dist_ckpt.launcher_api import MEMORY_DIR_PREFIX, MEMORY_REMOVING_PREFIX, memory_base_dir, memory_dir

log = logging.getLogger(__name__)

OWNER_NAME = "owner.json"
LOCK_NAME = "owner.lock"
MAX_SCANNED = 1000  # entries of the base directory looked at per start: bounded work


class OwnedElsewhere(OSError):
    """The directory has a live owner (or one this process cannot prove dead)."""


def _start_ticks(pid: int) -> int | None:
    # field 22 of /proc/PID/stat: tells a reused pid from the launcher that wrote owner.json
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
        return int(text.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _lock(directory: str) -> int | None:
    """The directory's owner lock, taken without waiting; None while another process holds it.
    The descriptor is not inherited by the launcher's children (PEP 446): the lock ends with
    the launcher, not with its last worker."""
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return None
        raise
    return fd


def _same_file(fd: int, path: str) -> bool:
    # a remover may have renamed the directory away between our open and our lock
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _owner(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, OWNER_NAME), encoding="utf-8") as handle:
            owner = json.loads(handle.read(4096))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def _dead_reason(owner: dict[str, Any]) -> str | None:
    """Why the launcher ``owner`` records is provably gone, or None (alive, or unknown)."""
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


def describe_owner(directory: str) -> str:
    owner = _owner(directory)
    if owner is None:
        return "an owner without a readable owner.json"
    return f"launcher pid {owner['pid']} on {owner.get('host')} (root {owner.get('root')})"


def _removal(directory: str) -> None:
    """Rename, then delete: a half-removed directory never keeps a job's name."""
    parent, name = os.path.split(directory)
    doomed = os.path.join(parent, f"{MEMORY_REMOVING_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


@dataclass
class Owned:
    """A claimed directory; the lock is held until :meth:`remove` or :meth:`release`."""

    path: str
    fd: int | None

    def used_bytes(self) -> int:
        """Bytes of the files under the directory (its share of the node's memory)."""
        total = 0
        for parent, _dirs, files in os.walk(self.path):
            for name in files:
                with contextlib.suppress(OSError):  # removed by a prune while we walk
                    total += os.lstat(os.path.join(parent, name)).st_size
        return total

    def remove(self) -> bool:
        """The launcher when it stops: remove its directory (still holding the lock, so nobody
        takes it over half removed); True when it existed."""
        try:
            if not os.path.lexists(self.path):
                return False
            _removal(self.path)
            return True
        finally:
            self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim(run_id: str, root: str, base: str | None = None) -> Owned:
    """The launcher: own the job's directory (created when missing). Raises
    :class:`OwnedElsewhere` when a live launcher (or one not provably dead) owns it."""
    directory = memory_dir(run_id, root, base)
    for _ in range(3):  # a directory renamed away under us is claimed afresh
        os.makedirs(directory, exist_ok=True)
        try:
            fd = _lock(directory)
        except FileNotFoundError:
            continue  # renamed away between the two calls
        if fd is None:
            raise OwnedElsewhere(f"{directory} is owned by {describe_owner(directory)}")
        if not _same_file(fd, os.path.join(directory, LOCK_NAME)):
            os.close(fd)
            continue
        try:
            _record(directory, run_id, root)
        except BaseException:
            os.close(fd)
            raise
        return Owned(directory, fd)
    raise OwnedElsewhere(f"{directory} kept being removed while it was claimed")


def _record(directory: str, run_id: str, root: str) -> None:
    """Write owner.json under the lock: linked into place when there is none; a previous
    owner's record is replaced only when that launcher is provably dead."""
    me = {"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
          "host": socket.gethostname(), "run_id": run_id, "root": root}
    path = os.path.join(directory, OWNER_NAME)
    temporary = os.path.join(directory, f".{OWNER_NAME}.{uuid.uuid4().hex[:8]}")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(me, handle)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        try:
            os.link(temporary, path)  # fails when a record exists: never a silent overwrite
            return
        except FileExistsError:
            pass
        previous = _owner(path.rpartition(os.sep)[0])
        # the lock is ours, so its holder is gone; a record of a live pid (a launcher of an
        # older version, which took no lock) is still never overwritten
        if previous is not None and previous["pid"] != os.getpid() and _dead_reason(previous) is None:
            raise OwnedElsewhere(f"{directory} is owned by {describe_owner(directory)}")
        if previous is not None:
            log.info("taking over in-memory checkpoints %s from %s", directory,
                     _dead_reason(previous) or "this process")
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def stale_reason(directory: str) -> str | None:
    """Why ``directory`` provably belongs to a dead launcher, or None (alive, or unknown: a
    directory without an owner file, or another host's, is never called stale). Takes the
    owner lock only to look: released before returning."""
    owner = _owner(directory)
    if owner is None:
        return None
    try:
        fd = _lock(directory)
    except OSError:
        return None
    if fd is None:
        return None  # its launcher holds the lock: alive
    os.close(fd)
    return _dead_reason(owner)


def remove_stale(base: str | None = None, *, keep: str | None = None) -> list[str]:
    """The launcher at start: remove the directories of dead launchers (not ``keep``), and what
    an interrupted removal left; returns the job directories removed. Looks at no more than
    ``MAX_SCANNED`` entries of the base."""
    base = base or memory_base_dir()
    try:
        with os.scandir(base) as entries:
            names = [e.name for _, e in zip(range(MAX_SCANNED), entries, strict=False)
                     if e.name.startswith((MEMORY_DIR_PREFIX, MEMORY_REMOVING_PREFIX))
                     and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    removed = []
    for name in names:
        directory = os.path.join(base, name)
        if name.startswith(MEMORY_REMOVING_PREFIX):
            shutil.rmtree(directory, ignore_errors=True)  # nobody's any more
            continue
        if directory == keep or (owner := _owner(directory)) is None:
            continue
        try:
            fd = _lock(directory)
        except OSError:
            continue
        if fd is None:
            continue  # a live launcher holds it
        try:
            reason = _dead_reason(owner)
            if reason is None:
                continue
            log.info("removing stale in-memory checkpoints %s: %s", directory, reason)
            with contextlib.suppress(FileNotFoundError):
                _removal(directory)
            removed.append(directory)
        finally:
            os.close(fd)
    return removed
