"""Retention: a pure policy over generation names, and a separate pruner that deletes."""

from __future__ import annotations

import logging

from .manifest import parse_generation
from .storage.base import Backend

log = logging.getLogger(__name__)


def to_drop(names: list[str], *, keep_last: int, pinned: frozenset[str] = frozenset()) -> list[str]:
    """Names to delete: all but the newest ``keep_last`` (by update number) and the pinned."""
    ordered = sorted(names, key=lambda n: parse_generation(n) or 0, reverse=True)
    return [n for n in ordered[keep_last:] if n not in pinned]


def prune(backend: Backend, committed: list[str], *, keep_last: int,
          pinned: frozenset[str] = frozenset(), dry_run: bool = False) -> list[str]:
    """Delete old generations; call only after the newest validated. Failures are logged."""
    dropped = to_drop(committed, keep_last=keep_last, pinned=pinned)
    for name in dropped if not dry_run else []:
        try:
            backend.remove_tree(name)
        except OSError as exc:
            log.warning("could not prune %s: %s", name, exc)
    return dropped
