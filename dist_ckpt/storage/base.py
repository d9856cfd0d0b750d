"""The read-side storage protocol shared by restore, validation, retention and the CLI."""

from __future__ import annotations

from typing import Protocol


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


def open_backend(root: str) -> Backend:
    from .local import LocalBackend

    if "://" in root and not root.startswith("file://"):
        raise NotImplementedError(f"no backend for {root!r} yet (object storage is issue 4)")
    return LocalBackend(root.removeprefix("file://"))
