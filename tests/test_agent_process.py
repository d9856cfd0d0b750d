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
                   "sigpwr_default": signal.getsignal(signal.SIGPWR) == signal.SIG_DFL,
                   "sigint": getattr(signal.getsignal(signal.SIGINT), "__name__", None)
                   or signal.Handlers(signal.getsignal(signal.SIGINT)).name}, out)
    os.rename(argv[0] + ".tmp", argv[0])
    return int(argv[1])


def _wait_for_sigterm(argv: list[str]) -> int:
    open(argv[0], "w").close()
    signal.sigwait({signal.SIGTERM})
    return 9


@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_the_forked_agent_starts_as_a_fresh_process_would(tmp_path, sigint: str) -> None:
    """SIGINT as an interpreter started here would have it: KeyboardInterrupt after the
    launcher's own handler, but still ignored where the launcher inherited it ignored (a job
    started in the background by a non-interactive shell: an interpreter keeps SIG_IGN)."""
    report = str(tmp_path / "report.json")
    held = open(tmp_path / "lock", "w")  # as the launcher's memory-directory lock
    # as the launcher's handlers: its own, and a --preempt-signal of the user's choice
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGPWR)}
    previous[signal.SIGINT] = signal.signal(
        signal.SIGINT, (lambda *_: None) if sigint == "handled" else signal.SIG_IGN)
    try:
        agent = AgentProcess([report, "3"], {"ONLY": "this"}, target=_describe)
        assert agent.wait(timeout=60) == 3 and agent.returncode == 3 and agent.poll() == 3
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        held.close()
    seen = json.loads(open(report).read())
    assert seen["session"] == seen["pid"] == agent.pid  # its own session: ended as a group
    assert seen["env"] == {"ONLY": "this"}
    assert seen["fds"] == [0, 1, 2, 3]  # stdin, stdout, stderr, and the listing's own
    assert seen["sigterm_default"] and seen["sigpwr_default"]
    assert seen["sigint"] == ("default_int_handler" if sigint == "handled" else "SIG_IGN")


def _exit(argv: list[str]) -> int:
    how = argv[0]
    raise SystemExit(None if how == "none" else int(how) if how.isdigit() else how)


@pytest.mark.parametrize(("how", "code"), [("none", 0), ("4", 4), ("a message", 1)])
def test_the_agent_exits_as_an_interpreter_would(how: str, code: int) -> None:
    agent = AgentProcess([how], {}, target=_exit)
    assert agent.wait(timeout=60) == code


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


def test_a_start_joins_again_a_rendezvous_still_closing_but_not_after_its_workers_ran(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from dist_ckpt import launcher_api as api
    from dist_ckpt.marks import MarkWriter, marks_path
    from launch import agent

    calls: list[int] = []

    def closed_twice(_args: object) -> None:
        calls.append(len(calls))
        if len(calls) <= 2:
            raise RendezvousClosedError()

    monkeypatch.setattr(agent, "run", closed_twice)
    monkeypatch.setattr(agent, "CLOSED_PAUSE_S", 0.01)
    monkeypatch.setenv(api.LAUNCH_DIR_ENV, str(tmp_path))
    agent._run_once_open(None)
    assert calls == [0, 1, 2]
    # a worker of this start trained: a closed rendezvous now is the job's, not the last start's
    MarkWriter(marks_path(str(tmp_path), 0)).mark(1)
    calls.clear()
    with pytest.raises(RendezvousClosedError):
        agent._run_once_open(None)
    assert calls == [0]
    # and never past the bound
    monkeypatch.setattr(agent, "CLOSED_RETRY_S", 0.0)
    monkeypatch.setenv(api.LAUNCH_DIR_ENV, str(tmp_path / "empty"))
    calls.clear()
    with pytest.raises(RendezvousClosedError):
        agent._run_once_open(None)
    assert calls == [0]


def test_torchruns_line_for_a_preemption_exit_says_it_is_expected() -> None:
    """Issue 40 item 15: torch logs every non-zero worker exit as a failure; the agent's filter
    marks exit 75 (a worker's preemption exit after its save) as the expected one, and leaves
    every other line as torch wrote it."""
    import logging

    from dist_ckpt.launcher_api import PREEMPTED_EXIT
    from launch.agent import ExpectedExits

    def line(code: int) -> str:
        record = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR, "api.py",
                                   1, "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                                   (code, 0, 123, "python"), None)
        assert ExpectedExits().filter(record)
        return record.getMessage()

    assert line(PREEMPTED_EXIT).endswith("[expected: exit 75 is a worker's preemption exit after its save]")
    assert line(-9) == "failed (exitcode: -9) local_rank: 0 (pid: 123) of binary: python"
