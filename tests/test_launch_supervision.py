"""The launcher's supervision logic without processes: option parsing, the crash-loop count,
the preemption's steps, and how a preempted start is classified."""

from __future__ import annotations

import os
import signal

import pytest

from dist_ckpt.launcher_api import PREEMPT_NOTICE_NAME
from launch import policy
from launch.options import parse
from launch.preemption import Preemption, Step


def test_preemption_options() -> None:
    defaults = parse(["--checkpoint-root", "/r", "train.py"])
    assert (defaults.preempt_signal, defaults.grace_s, defaults.max_no_progress) == (signal.SIGTERM, 60.0, 2)
    for name in ("USR1", "SIGUSR1", "usr1", str(int(signal.SIGUSR1))):
        options = parse(["--checkpoint-root", "/r", "--preempt-signal", name, "--grace", "5",
                         "--max-no-progress", "0", "train.py"])
        assert (options.preempt_signal, options.grace_s, options.max_no_progress) == (signal.SIGUSR1, 5.0, 0)
        assert options.torchrun_argv == ["--max-restarts", "0", "train.py"]
    for bad in (["--preempt-signal", "KILL"], ["--preempt-signal", "NOPE"], ["--grace", "-1"],
                ["--max-no-progress", "-1"]):
        with pytest.raises(SystemExit):
            parse(["--checkpoint-root", "/r", *bad, "train.py"])


def test_crash_loop_counts_failed_starts_at_the_same_update() -> None:
    loop = policy.CrashLoop(2)
    assert loop.failed(0, 4) is None  # progress: a generation past the resume point
    assert loop.failed(4, 4) is None
    assert loop.failed(4, 4) == "crash loop at update 4"
    loop = policy.CrashLoop(2)
    assert loop.failed(4, 4) is None
    assert loop.failed(6, 4) is None, "resumed further on (a generation in memory): a new count"
    assert loop.failed(6, None) == "crash loop at update 6"
    assert loop.failed(None, None) is None  # unknown resume point: a start at 0, a new count
    never = policy.CrashLoop(0)
    assert all(never.failed(3, 3) is None for _ in range(5))


def test_preemption_notice_then_grace_then_end(tmp_path) -> None:
    preemption = Preemption(grace_s=0.0)
    assert preemption.step(str(tmp_path)) is Step.WAIT and not preemption.pending
    preemption.requested("stop file exists", signal=False)
    preemption.requested("stop file exists", signal=False)  # polled again: not a second request
    assert preemption.step(str(tmp_path)) is Step.NOTIFIED and preemption.noticed
    assert (tmp_path / PREEMPT_NOTICE_NAME).read_text() == "stop file exists"
    assert preemption.step(str(tmp_path)) is Step.END and "grace" in preemption.ended_why
    assert preemption.step(str(tmp_path)) is Step.WAIT  # ended once


def test_second_signal_ends_at_once(tmp_path) -> None:
    preemption = Preemption(grace_s=3600.0)
    preemption.requested("SIGTERM received", signal=True)
    assert preemption.step(str(tmp_path)) is Step.NOTIFIED
    assert preemption.step(str(tmp_path)) is Step.WAIT
    preemption.requested("SIGTERM received", signal=True)
    assert preemption.step(str(tmp_path)) is Step.END
    assert preemption.ended_why == "a second preemption request" and preemption.reason == "SIGTERM received"
    preemption.over()
    assert 0 <= preemption.seconds() < 60


def test_a_preempted_start_is_classified_by_reports_not_exit_codes(tmp_path) -> None:
    root = str(tmp_path)
    os.makedirs(root, exist_ok=True)
    result = {"ok": False, "failures": {"0": {"exitcode": 75}, "1": {"exitcode": -15, "signal": "SIGTERM"}},
              "signal": None, "error": None}
    reports = {0: {"rank": 0, "next_update": 4, "preempted": "gen-000000000009", "preempted_update": 9},
               1: {"rank": 1, "next_update": 4}}
    verdict = policy.classify(run_root=root, reports=reports, result=result, agent_rc=1, stop_reason=None,
                              mirror=None, preempted=True)
    assert (verdict.kind, verdict.reason) == ("preempted", "saved gen-000000000009 at update 9")
    # another node's launcher gave the notice: this node's reports still say so
    verdict = policy.classify(run_root=root, reports=reports, result=result, agent_rc=1, stop_reason=None,
                              mirror=None, preempted=False)
    assert verdict.kind == "preempted"
    nothing = policy.classify(run_root=root, reports={1: {"rank": 1, "next_update": 4}}, result=result,
                              agent_rc=1, stop_reason=None, mirror=None, preempted=True)
    assert nothing.kind == "stopped" and "before any new generation" in nothing.reason
