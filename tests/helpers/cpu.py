"""CPU of a test: what this process and every process below it spent while the test ran.

Read from ``/proc``: for this process and each live descendant, user + system time of its own
and of the children it has waited for (``utime + stime + cutime + cstime``). A process that
started and ended during the test shows in its parent's children's time once reaped (a rank
forked by a fork server, a launcher chain, a CLI subprocess), and a long-lived helper (the
fork server, the worker's moto server) counts only what it spent during the test.

Call order: ``before = tree_cpu()`` when a test starts, ``spent(before, tree_cpu())`` when
it ends; one pytest worker runs one test at a time, so what its tree spent in between is
that test's.
"""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, seconds of CPU of the process and its reaped children), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    # the command name, in parentheses, may hold spaces: the fields start after its last ')'
    fields = text[text.rfind(b")") + 2:].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return int(fields[1]), (utime + stime + cutime + cstime) / _TICKS


def tree_cpu(root: int | None = None) -> dict[int, float]:
    """pid -> CPU seconds (own and reaped children's) of ``root`` (default: this process)
    and every live process below it."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    seconds: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _stat(name)
        if stat is not None:
            children.setdefault(stat[0], []).append(int(name))
            seconds[int(name)] = stat[1]
    tree: dict[int, float] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        if pid in seconds and pid not in tree:
            tree[pid] = seconds[pid]
            pending.extend(children.get(pid, ()))
    return tree


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the tree spent between two readings. A process alive at both counts its
    difference; one that is new counts all of its time; one that ended in between has its
    whole life in its reaper's children's time, so what it had spent before is taken off."""
    total = sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())
    total -= sum(seconds for pid, seconds in before.items() if pid not in after)
    return max(0.0, total)
