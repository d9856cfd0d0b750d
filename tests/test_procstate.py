"""launch/procstate.py: a stopped process is seen as stopped, a running one is not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from launch.procstate import process_state, stopped_ranks


@dataclass(frozen=True)
class P:
    pid: int


@pytest.mark.processes
def test_a_sigstopped_process_is_stopped_and_a_continued_one_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert stopped_ranks({0: P(child.pid), 1: P(os.getpid())}) == frozenset()
        os.kill(child.pid, signal.SIGSTOP)
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once the child is stopped
        assert os.WIFSTOPPED(status)
        assert stopped_ranks({0: P(child.pid), 1: P(os.getpid())}) == frozenset({0})
        os.kill(child.pid, signal.SIGCONT)
        _, status = os.waitpid(child.pid, os.WCONTINUED)  # returns once it runs again
        assert os.WIFCONTINUED(status)
        assert stopped_ranks({0: P(child.pid)}) == frozenset()
    finally:
        child.kill()
        child.wait()


def test_a_gone_pid_or_no_pid_counts_as_running() -> None:
    assert process_state(2**22 + 12345) is None
    assert stopped_ranks({0: P(0), 1: P(2**22 + 12345)}) == frozenset()
