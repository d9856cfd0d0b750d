"""The launcher's start: torchrun's agent forked from the launcher (``launch/agent_process.py``)
is what a fresh interpreter would be: its own session, the start's environment only, default
signal handlers, none of the launcher's files, and its exit status back as a Popen's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from launch.agent_process import AgentProcess

pytestmark = pytest.mark.processes


def _describe(argv: list[str]) -> int:
    """The child: what it inherited, into argv[0]; exits with argv[1]."""
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    with open(argv[0] + ".tmp", "w") as out:
        json.dump({"session": os.getsid(0), "pid": os.getpid(), "env": dict(os.environ), "fds": fds,
                   "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                   "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler}, out)
    os.rename(argv[0] + ".tmp", argv[0])
    return int(argv[1])


def _wait_for_sigterm(argv: list[str]) -> int:
    open(argv[0], "w").close()
    signal.sigwait({signal.SIGTERM})
    return 9


def test_the_forked_agent_starts_as_a_fresh_process_would(tmp_path) -> None:
    report = str(tmp_path / "report.json")
    held = open(tmp_path / "lock", "w")  # as the launcher's memory-directory lock
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as the launcher's handler
    try:
        agent = AgentProcess([report, "3"], {"ONLY": "this"}, target=_describe)
        assert agent.wait(timeout=60) == 3 and agent.returncode == 3 and agent.poll() == 3
    finally:
        signal.signal(signal.SIGTERM, previous)
        held.close()
    seen = json.loads(open(report).read())
    assert seen["session"] == seen["pid"] == agent.pid  # its own session: ended as a group
    assert seen["env"] == {"ONLY": "this"}
    assert seen["fds"] == [0, 1, 2, 3]  # stdin, stdout, stderr, and the listing's own
    assert seen["sigterm_default"] and seen["sigint_default"]


def test_wait_times_out_while_the_agent_runs_and_a_signal_ends_it(tmp_path) -> None:
    started = str(tmp_path / "started")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited: sigwait receives it
    try:
        agent = AgentProcess([started], {}, target=_wait_for_sigterm)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    ready, deadline = threading.Event(), time.monotonic() + 60
    while not os.path.exists(started) and agent.poll() is None and time.monotonic() < deadline:
        ready.wait(0.01)
    assert os.path.exists(started)
    with pytest.raises(subprocess.TimeoutExpired):
        agent.wait(timeout=0.2)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 9
    agent.send_signal(signal.SIGTERM)  # an ended agent: nothing to signal, no error
