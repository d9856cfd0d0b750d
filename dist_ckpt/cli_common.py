"""What every ``dist-ckpt`` subcommand shares: the usage error, sizes, opening a root."""

from __future__ import annotations

from .errors import StorageError
from .storage.base import Backend, open_backend

PROG = "dist-ckpt"


class UsageError(Exception):
    """A problem with the command line or the root; reported with exit status 2."""


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def open_root(root: str) -> Backend:
    """Open ``root`` and check it is a readable directory."""
    try:
        backend = open_backend(root)
        found = backend.exists("")
    except (StorageError, OSError, ValueError) as exc:
        raise UsageError(f"cannot open checkpoint root {root!r}: {exc}") from exc
    if not found:
        raise UsageError(f"checkpoint root {root!r} does not exist")
    try:
        backend.listdir("")
    except (StorageError, OSError) as exc:
        raise UsageError(f"checkpoint root {root!r} is not a readable directory: {exc}") from exc
    return backend
