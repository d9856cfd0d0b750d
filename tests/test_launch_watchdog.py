"""The launcher's watchdog on real jobs: a SIGSTOPped rank ends its start as ``hung`` and the job
finishes bitwise; a save slower than the hang timeout is no hang; stragglers are named, and
nobody in a balanced run. Unit tests of the rules: tests/test_watchdog.py."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time

import pytest
import torch

from dist_ckpt.testing import free_port
from tests.helpers import launchlib
from tests.helpers.launchlib import launch

pytestmark = [pytest.mark.timeout(600)]
STALL_JOB = os.path.join(launchlib.REPO, "tests", "helpers", "stall_job.py")


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch_timed(root: str, *launcher_args: str, script_args: tuple[str, ...],
                 watch_for: str, timeout: float) -> tuple[launchlib.Launched, float | None]:
    """``launchlib.launch`` that also notes (unix time) when a line starting ``watch_for`` came."""
    before = len(launchlib.read_log(root))
    proc = subprocess.Popen(launchlib.command(root, *launcher_args, script=STALL_JOB,
                                              script_args=script_args),
                            cwd=launchlib.REPO, env=launchlib.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    seen_at, lines = None, []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if seen_at is None and line.startswith(watch_for):
                seen_at = time.time()
        proc.wait()
    finally:
        timer.cancel()
        proc.kill()
    return launchlib.Launched(proc.returncode, "".join(lines), launchlib.read_log(root)[before:]), seen_at


# not a launcher-slot test: for the 60 s of the default hang timeout one worker is stopped and
# the other blocked in a collective, so the machine is idle; it runs beside the first session's
# tests instead of holding one of the two launcher slots for 80 s (docs/testing.md)
@pytest.mark.processes
@pytest.mark.long(reason="the default (auto) hang timeout is at least 60 s, then a 10 s grace and a restart")
@pytest.mark.parametrize("stop_at", [6, 8], ids=["between-saves", "peer-waits-in-save"])
def test_sigstopped_rank_is_detected_and_the_job_finishes_bitwise(tmp_path, stop_at: int) -> None:
    # 6: rank 0 waits in the next step's collective, outside any section; 8: rank 1 stops
    # before the save of update 8 and rank 0 waits for it inside save() (issue 38: the save's
    # deadline, 3 x commit_timeout_s, must neither delay the verdict nor make rank 0 the suspect)
    args = ("--updates", "12", "--save-every", "4", "--commit-timeout", "30")
    root, marker = str(tmp_path / "root"), tmp_path / "stopped"
    result, detected = launch_timed(
        root, "--backoff", "0.5", watch_for="[launch] hung:", timeout=480,
        script_args=("--sigstop-at", str(stop_at), "--sigstop-rank", "1", "--marker", str(marker), "--",
                     *args, "--dump-final", str(tmp_path / "final.pt")))
    assert result.returncode == 0, result.output[-4000:]
    first, second = result.starts
    assert first["classification"] == "hung", first
    assert f"suspect rank 1 (update {stop_at - 1}, last mark" in first["reason"], first["reason"]
    assert "suspect rank 0" not in first["reason"], first["reason"]
    if stop_at == 8:
        assert "while rank(s) 0 wait in save" in first["reason"], first["reason"]
    assert "hung: no progress for" in result.output and "suspect rank 1" in result.output
    assert second["classification"] == "done" and second["resumed_from"] == "gen-000000000004"
    stopped_unix, stopped_pid = marker.read_text().split()
    assert not running(int(stopped_pid)), "the SIGSTOPped rank survived its start"
    assert detected is not None
    delay = detected - float(stopped_unix)
    timeout = float(re.search(r"hang timeout ([\d.]+) s", first["reason"]).group(1))
    print(f"\nstop to detection: {delay:.1f} s (hang timeout {timeout:g} s)")
    assert timeout - 1 <= delay <= timeout + 15, f"detected {delay:.1f} s after the stop"
    expected = launchlib.uninterrupted(12)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert expected.keys() == final.keys() and len(final) > 4
    assert all(torch.equal(expected[k], final[k]) for k in expected), "resumed run diverged"


@pytest.mark.launcher
def test_a_save_slower_than_the_hang_timeout_is_no_hang(tmp_path, monkeypatch) -> None:
    # every rank's writer sleeps 8 s before each save's first byte: a slow disk, inside the
    # save section (well within the example's 120 s commit timeout)
    monkeypatch.setenv("DIST_CKPT_FAULTS", '{"write.before": {"delay_s": 8}}')
    root = str(tmp_path / "root")
    result = launch(root, "--hang-timeout", "5", "--backoff", "0.5",
                    script_args=("--updates", "6", "--save-every", "3"))
    assert result.returncode == 0, result.output[-4000:]
    assert [s["classification"] for s in result.starts] == ["done"], result.output[-4000:]
    assert "hung" not in result.output
    assert result.starts[0]["duration_s"] >= 16  # two saves of 8 s or more each


@pytest.mark.launcher
def test_a_straggler_is_named_and_nobody_in_a_balanced_run(tmp_path) -> None:
    job = ("--updates", "45", "--save-every", "100")
    # every rank works 0.1 s per update; rank 1 another 0.1 s of its own after its optimizer step
    lagging = launch(str(tmp_path / "lagging"), script=STALL_JOB, script_args=(
        "--work-s", "0.1", "--slow-rank", "1", "--slow-extra-s", "0.1", "--", *job))
    assert lagging.returncode == 0, lagging.output[-4000:]
    named = re.findall(r"\[launch\] straggler: rank (\d+) on \S+ median ([\d.]+) s/update, "
                       r"job median ([\d.]+) s/update", lagging.output)
    assert [rank for rank, _, _ in named] == ["1"], lagging.output[-4000:]
    assert float(named[0][1]) > 1.5 * float(named[0][2])
    ranks = lagging.starts[0]["ranks"]
    assert ranks["1"]["straggler"] and not ranks["0"]["straggler"], ranks
    assert ranks["1"]["updates_seen"] >= 40

    balanced = launch(str(tmp_path / "balanced"), script=STALL_JOB,
                      script_args=("--work-s", "0.1", "--", *job))
    assert balanced.returncode == 0, balanced.output[-4000:]
    assert "[launch] straggler" not in balanced.output and "a straggler" not in balanced.output, \
        balanced.output[-4000:]
    ranks = balanced.starts[0]["ranks"]
    assert sorted(ranks) == ["0", "1"] and not any(r["straggler"] for r in ranks.values()), ranks
    assert all(r["updates_seen"] >= 40 and r["median_s_per_update"] > 0 for r in ranks.values())


@pytest.mark.launcher
@pytest.mark.long(reason="two launchers as two nodes, each starting torchrun's agent and a worker "
                         "twice, with a 10 s hang timeout and up to a 10 s grace between the starts")
def test_two_nodes_both_detect_a_hang_on_one_node(tmp_path) -> None:
    args = ("--updates", "10", "--save-every", "2")
    root, marker, port = str(tmp_path / "root"), tmp_path / "stopped", free_port()
    procs = [subprocess.Popen(
        launchlib.command(root, "--run-id", "job", "--hang-timeout", "10", "--backoff", "1", nproc=1,
                          nnodes=2, rdzv_port=port, rdzv_id="hang-two-nodes", script=STALL_JOB,
                          script_args=("--sigstop-at", "5", "--sigstop-rank", "1", "--marker",
                                       str(marker), "--", *args,
                                       "--dump-final", str(tmp_path / f"final{node}.pt"))),
        cwd=launchlib.REPO, env=launchlib.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for node in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=420)[0])
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-4000:]
        assert "[launch] hung: no progress for" in output, output[-4000:]
    log = launchlib.read_log(root)  # both launchers append to the shared root's log
    assert sorted(s["classification"] for s in log) == ["done", "done", "hung", "hung"], log
    assert any("suspect rank 1 (update 4," in s["reason"] for s in log if s["classification"] == "hung")
    assert not running(int(marker.read_text().split()[1]))
    final = tmp_path / "final0.pt" if (tmp_path / "final0.pt").exists() else tmp_path / "final1.pt"
    expected = launchlib.uninterrupted(10)
    got = torch.load(final, weights_only=True)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
