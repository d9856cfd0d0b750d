"""The storage protocols: bytes under '/'-separated names below a root, nothing more.

The storage layer knows no manifest, no DCP layout and no generation: the format layer
(``dist_ckpt.format``) and the commit tiers (``dist_ckpt.tiers``) give names their meaning.
Readers (validation, inventory, restore, the CLI) take a :class:`StoreReader`; writers (the
tiers, retention, pins) a :class:`Store`. Paths are relative to the root; implementations
reject nothing themselves, callers validate names first.
"""

from __future__ import annotations

import os
from typing import IO, Any, Protocol

from ..errors import UnsafeFileError


class StoreReader(Protocol):
    root: str

    def url(self, rel: str) -> str: ...

    def exists(self, rel: str) -> bool: ...

    def listdir(self, rel: str) -> list[str]: ...

    def read_bytes(self, rel: str) -> bytes: ...

    def open_read(self, rel: str) -> IO[bytes]: ...

    def size(self, rel: str) -> int: ...

    def checked_size(self, rel: str, *, limit: int | None = None,
                     sound_dirs: set[str] | None = None) -> int:
        """The size of ``rel`` if it is a regular file reached without following a link (no
        FIFO or device is ever opened) and at most ``limit`` bytes; else ``UnsafeFileError``.
        ``FileNotFoundError`` when missing. ``sound_dirs``: a cache of directories found sound."""

    def digest(self, rel: str, algorithm: str) -> str:
        """Hex digest of ``rel``'s bytes with ``algorithm`` (``dist_ckpt.digests``)."""

    def tree_size(self, rel: str) -> int:
        """Bytes of every file below ``rel`` (0 when absent)."""

    def local_path(self, rel: str) -> str | None:
        """Where ``rel`` lies on this machine's filesystem (which has inodes and renames), or
        None for a store without one (an object store)."""


class StoreWriter(Protocol):
    def put_bytes(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically (readers see the old or the new bytes)."""

    def put_file(self, local_path: str, rel: str) -> None: ...

    def create_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` only if it does not exist; ``FileExistsError`` when it does."""

    def remove_tree(self, rel: str) -> None: ...

    def abort_uploads(self, rel: str) -> int:
        """Abort unfinished uploads below ``rel``; returns how many (0 where none exist)."""


class Store(StoreReader, StoreWriter, Protocol):
    """Read and write access below one root."""


def read_bounded(store: StoreReader, rel: str, limit: int) -> bytes:
    """A small file's bytes: only a regular file reached without a link (a FIFO would block
    the reader), at most ``limit`` bytes; raises as ``checked_size`` and ``read_bytes`` do."""
    store.checked_size(rel, limit=limit)
    raw = store.read_bytes(rel)
    if len(raw) > limit:  # it grew after the check
        raise UnsafeFileError(f"{len(raw)} bytes, over the {limit} byte bound")
    return raw


def is_remote(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def open_store(root: str, storage_options: dict[str, Any] | None = None) -> Store:
    """A local store for paths and ``file://``; an fsspec object store otherwise."""
    if is_remote(root):
        from .objectstore import ObjectStore

        return ObjectStore(root, storage_options)
    from .local import LocalStore

    return LocalStore(root.removeprefix("file://"))


def parent_url(root: str, levels: int) -> str | None:
    """``root`` with its last ``levels`` components removed (a path or a URL); None when the
    root has fewer components than that."""
    scheme, sep, path = root.partition("://")
    if sep and scheme != "file" and levels == 0:
        return root
    if not sep or scheme == "file":
        path = os.path.abspath(root.removeprefix("file://"))
        for _ in range(levels):
            path = os.path.dirname(path)
        return path
    parts = path.rstrip("/").split("/")
    return f"{scheme}://{'/'.join(parts[:-levels])}" if len(parts) > levels else None
