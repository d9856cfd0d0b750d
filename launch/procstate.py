"""Which ranks' processes are stopped (SIGSTOP, a debugger's stop): read from ``/proc``.

A stopped rank keeps the mark it had, and a mark inside a library section reads as work in
progress until the section's deadline; the watchdog needs to know that the process cannot be
working. Linux only (``/proc/<pid>/stat``); elsewhere, or for a pid that is gone, the rank
counts as running, as before this check existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

STOPPED_STATES = frozenset("Tt")  # stopped by a signal, stopped by a tracer


class HasPid(Protocol):
    @property
    def pid(self) -> int: ...


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``T``...), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            stat = handle.read()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces or parentheses: the state
    # follows the last closing one
    _, _, rest = stat.rpartition(")")
    fields = rest.split()
    return fields[0] if fields else None


def stopped_ranks(marks: Mapping[int, HasPid]) -> frozenset[int]:
    """The ranks whose process (by the pid in its mark) is stopped now."""
    return frozenset(rank for rank, mark in marks.items()
                     if mark.pid > 0 and process_state(mark.pid) in STOPPED_STATES)
