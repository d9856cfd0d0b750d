"""What every ``dist-ckpt`` subcommand shares: the usage and refusal errors, warnings, sizes,
opening a root."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import StorageError, UnsafeNameError
from ..format.inventory import GenerationInfo, inventory
from ..format.manifest import (
    LATEST_NAME,
    check_generation_name,
    expand_generation_name,
    pending_update,
)
from ..format.signing import key_from_env
from ..storage.base import Store, StoreReader
from ..tiers import CommitTier, open_tier

PROG = "dist-ckpt"


class UsageError(Exception):
    """A problem with the command line or the root; reported with exit status 2."""


class Refused(Exception):
    """A well-formed request the command declines (a valid generation to delete, a pinned one
    to move, an unpin of what is not pinned); reported with exit status 1."""


def warn(message: str) -> None:
    """A problem worth knowing that does not change the exit status (stderr, text output)."""
    print(f"{PROG}: warning: {message}", file=sys.stderr)


@contextmanager
def reported_here() -> Iterator[None]:
    """Around a library call whose outcome the command prints itself (quarantine's move): the
    library's own warning about it (meant for a job's log) is held back, so the user reads the
    result once; errors still pass."""
    logger = logging.getLogger("dist_ckpt")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def human_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def open_root(root: str) -> Store:
    """Open ``root`` and check it is a readable directory."""
    return open_root_tier(root).store


def open_root_tier(root: str) -> CommitTier:
    """The commit tier at ``root``, checked to be a readable directory."""
    try:
        tier = open_tier(root)
        store = tier.store
        found = store.exists("")
    except (StorageError, OSError, ValueError) as exc:
        raise UsageError(f"cannot open checkpoint root {root!r}: {exc}") from exc
    if not found:
        raise UsageError(f"checkpoint root {root!r} does not exist")
    try:
        store.listdir("")
    except (StorageError, OSError) as exc:
        raise UsageError(f"checkpoint root {root!r} is not a readable directory: {exc}") from exc
    return tier




def generation_arg(name: str) -> str:
    """A generation name as typed on the command line (:func:`expand_generation_name`), for
    :func:`safe_generation_name` to judge."""
    return expand_generation_name(name)


def safe_generation_name(name: str) -> str:
    """The full generation name for ``name`` (short forms: :func:`generation_arg`); unsafe or
    malformed names are refused (exit 2). Every subcommand that takes GEN comes here."""
    full = generation_arg(name)
    try:
        check_generation_name(full)
    except UnsafeNameError as exc:
        raise UsageError(str(exc)) from exc
    return full


def checked_generation(store: Store, name: str) -> str:
    """The full name of generation ``name`` (short forms accepted), which must exist under
    ``store`` (else exit 2, as for unsafe or malformed names)."""
    full = safe_generation_name(name)
    if not store.exists(full):
        raise UsageError(f"no generation {full if full != name else repr(name)} under {store.root}")
    return full


def is_directory(store: StoreReader, rel: str) -> bool:
    try:
        store.listdir(rel)
    except (StorageError, OSError):
        return False
    return True


def latest_warnings(store: Store, latest: str | None) -> list[str]:
    """A pointer at a generation that is gone (pruned or moved aside by hand) is worth a word:
    restore never follows it, but scripts that read ``latest.json`` do."""
    if latest is None or store.exists(latest):
        return []
    return [f"{LATEST_NAME} points to {latest}, which does not exist under {store.root}"]


def update_number(info: GenerationInfo) -> int | None:
    return info.next_update if info.next_update is not None else pending_update(info.name)


def sorted_inventory(store: Store) -> list[GenerationInfo]:
    """All generations and pending directories, newest update number first."""
    def key(info: GenerationInfo) -> int:
        number = update_number(info)
        return -1 if number is None else number

    return sorted(inventory(store, digests=False, key=key_from_env()), key=key, reverse=True)


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)] + [row[-1]]
        print("  ".join(cells).rstrip())


def error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
