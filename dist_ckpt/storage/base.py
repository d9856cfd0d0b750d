"""The read-side storage protocol shared by restore, validation, retention and the CLI."""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint import StorageReader


class Backend(Protocol):
    """Read/list/delete access below a checkpoint root. Paths are '/'-separated and relative
    to the root; implementations reject nothing themselves, callers validate names first."""

    root: str

    def url(self, rel: str) -> str: ...

    def exists(self, rel: str) -> bool: ...

    def listdir(self, rel: str) -> list[str]: ...

    def read_bytes(self, rel: str) -> bytes: ...

    def size(self, rel: str) -> int: ...

    def sha256(self, rel: str) -> str: ...

    def remove_tree(self, rel: str) -> None: ...

    def dcp_reader(self, rel: str) -> StorageReader: ...

    def put_bytes(self, rel: str, data: bytes) -> None: ...


def is_remote(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def open_backend(root: str, storage_options: dict[str, Any] | None = None) -> Backend:
    """A local backend for paths and ``file://``; an fsspec object-store backend otherwise."""
    if is_remote(root):
        from .objectstore import ObjectStoreBackend

        return ObjectStoreBackend(root, storage_options)
    from .local import LocalBackend

    return LocalBackend(root.removeprefix("file://"))
