"""POSIX filesystem primitives: durable writes (tmp + fsync + rename + dir fsync)."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from typing import IO

from ..errors import StorageError

HASH_CHUNK = 8 << 20


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


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably: unique tmp name, fsync, rename, dir fsync."""
    directory = os.path.dirname(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_durable(path: str, data: bytes) -> None:
    """Write a new file and fsync it (no rename: used inside a private pending directory)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def file_sha256(path: str) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class LocalBackend:
    """Backend over a local (or shared POSIX) directory."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *[p for p in rel.split("/") if p]) if rel else self.root

    def url(self, rel: str) -> str:
        return self._path(rel)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(rel)))
        except FileNotFoundError as exc:
            raise StorageError(f"no such directory: {self._path(rel)}") from exc

    def read_bytes(self, rel: str) -> bytes:
        with open(self._path(rel), "rb") as handle:
            return handle.read()

    def size(self, rel: str) -> int:
        return os.path.getsize(self._path(rel))

    def sha256(self, rel: str) -> str:
        return file_sha256(self._path(rel))[1]

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
        return open(self._path(rel), "rb")

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
