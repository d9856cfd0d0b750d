"""POSIX filesystem primitives: durable writes (tmp + fsync + rename + dir fsync)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import uuid
from typing import IO, BinaryIO

from ..digests import HASH_CHUNK, hasher
from ..errors import StorageError, UnsafeFileError

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def free_bytes(path: str) -> int:
    """Free bytes of the filesystem holding ``path`` for an unprivileged writer; OSError when
    it cannot be measured."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, and each directory it creates is made durable in
    its parent (the parent fsynced, top down): a root created by the first save must survive a
    power cut with the generations renamed into it, or a committed generation is lost with
    its brand-new root's directory entry."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    if not missing:
        return
    os.makedirs(path, exist_ok=True)
    for created in reversed(missing):
        fsync_dir(os.path.dirname(created))


def write_durable(path: str, data: bytes) -> None:
    """Write a new file and fsync it (no rename: used inside a private pending directory)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably: readers see the old bytes or the new, never
    part of them. The durable temporary-file-then-rename every persistent file of the
    library uses: unique tmp name in the same directory, fsync, rename, directory fsync."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file, never following a final link
    and never blocking on a FIFO (checked on the open descriptor: no window after a check)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeFileError(f"{path} is {_kind(mode)}, not a regular file (refused)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_digest(path: str, algorithm: str) -> tuple[int, str]:
    """(size, hex digest) of a regular file, read once in large chunks."""
    digest = hasher(algorithm)
    size = 0
    with open_regular(path) as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class LocalStore:
    """A store over a local (or shared POSIX) directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *[p for p in rel.split("/") if p]) if rel else self.root

    def url(self, rel: str) -> str:
        return self._path(rel)

    def local_path(self, rel: str) -> str:
        """Where ``rel`` lies on this machine."""
        return self._path(rel)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(rel)))
        except FileNotFoundError as exc:
            raise StorageError(f"no such directory: {self._path(rel)}") from exc

    def read_bytes(self, rel: str) -> bytes:
        try:
            with open_regular(self._path(rel)) as handle:
                return handle.read()
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise UnsafeFileError(f"{self._path(rel)} is a symbolic link (refused)") from exc
            raise

    def size(self, rel: str) -> int:
        return os.path.getsize(self._path(rel))

    def checked_size(self, rel: str, *, limit: int | None = None,
                     sound_dirs: set[str] | None = None) -> int:
        # lstat of every component below the root: the library writes neither links nor
        # special files, a FIFO would block its reader and a link can leave the root
        parts = [p for p in rel.split("/") if p]
        current = self.root
        for index, part in enumerate(parts):
            current = os.path.join(current, part)
            last = index == len(parts) - 1
            if not last and sound_dirs is not None and current in sound_dirs:
                continue
            mode = os.lstat(current)
            if last and stat.S_ISREG(mode.st_mode):
                if limit is not None and mode.st_size > limit:
                    raise UnsafeFileError(f"{mode.st_size} bytes, over the {limit} byte bound "
                                          "(refused unread)")
                return mode.st_size
            if not last and stat.S_ISDIR(mode.st_mode):
                if sound_dirs is not None:
                    sound_dirs.add(current)
                continue
            where = "" if last else f"{'/'.join(parts[:index + 1])} "
            raise UnsafeFileError(f"{where}is {_kind(mode.st_mode)}, not a "
                                  f"{'regular file' if last else 'directory'} (refused unopened)")
        raise UnsafeFileError("is the root itself, not a file")

    def digest(self, rel: str, algorithm: str) -> str:
        return file_digest(self._path(rel), algorithm)[1]

    def tree_size(self, rel: str) -> int:
        return sum(os.path.getsize(os.path.join(folder, name))
                   for folder, _, names in os.walk(self._path(rel)) for name in names)

    def remove_tree(self, rel: str) -> None:
        path = self._path(rel)
        if os.path.isfile(path) or os.path.islink(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)

    def open_read(self, rel: str) -> IO[bytes]:
        return open_regular(self._path(rel))

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Replace a small file atomically and durably."""
        atomic_write(self._path(rel), data)

    def put_file(self, local_path: str, rel: str) -> None:
        target = self._path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(local_path, target)
        fsync_file(target)

    def create_exclusive(self, rel: str, data: bytes) -> None:
        path = self._path(rel)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(os.path.dirname(path))

    def abort_uploads(self, rel: str) -> int:
        return 0  # a POSIX write has no upload to abort
