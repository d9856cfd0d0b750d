"""Run a command; print its wall time and the CPU of every process it started.

``python3 scripts/cputime.py LABEL -- COMMAND...`` exits with the command's status. Standard
library only: ``.ci/run`` calls it before the project's environment exists.

The CPU is user + system time of the command and of every process below it, orphans
included: this process makes itself their subreaper (``PR_SET_CHILD_SUBREAPER``), so a
process whose parent ended first (a daemonised server, a fork server whose caller exited) is
reaped here and its time counted, instead of going to init uncounted. Orphans still running
when the command ends are waited for up to ``ORPHAN_GRACE_S``, then named and left running.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_GRACE_S = 10.0
ORPHAN_POLL_S = 0.05


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _reap_orphans() -> list[int]:
    """Reap every ended orphan handed to us, waiting up to ``ORPHAN_GRACE_S`` for those still
    running; the pids of any left."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    running = _reap_ended()
    while running and time.monotonic() < deadline:
        time.sleep(ORPHAN_POLL_S)
        running = _reap_ended()
    return running


def _reap_ended() -> list[int]:
    """Reap every ended child; the pids of the children still running."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid == 0:
            break
    running = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    text = handle.read()
            except OSError:
                continue
            if int(text[text.rfind(b")") + 2:].split()[1]) == os.getpid():
                running.append(int(name))
    return running


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    label, command = argv[0], argv[2:]
    counted = _become_subreaper()
    started = time.monotonic()
    status = subprocess.call(command)
    wall = time.monotonic() - started
    left = _reap_orphans()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    print(f"{label}: wall {wall:.0f} s, CPU {cpu:.1f} s (user {usage.ru_utime:.1f} + system "
          f"{usage.ru_stime:.1f}, every process it started{'' if counted else '; orphans not counted'})"
          f", {cpu / wall if wall else 0.0:.2f} cores busy on average")
    if left:
        print(f"{label}: still running after it ended (not counted): pids {sorted(left)}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
