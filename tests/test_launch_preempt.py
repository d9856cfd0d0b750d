"""``python -m launch`` as a supervisor: preemption (SIGTERM, ``--preempt-signal``, the stop
file), a second SIGTERM, crash loops, and health before a start.

Real torchrun jobs on 2 gloo ranks of ``scripts/train_example.py`` (slowed per update by
``tests/helpers/slow_example.py`` where the update reached at a signal matters)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid

import pytest
import torch

from dist_ckpt import marks, runinfo
from dist_ckpt.errors import PREEMPTED_EXIT
from dist_ckpt.format.manifest import MANIFEST_NAME
from dist_ckpt.format.validate import list_generations, validate
from dist_ckpt.launcher_api import PREEMPT_NOTICE_NAME, STARTS_DIR
from dist_ckpt.storage.local import LocalStore
from tests.helpers import launchlib
from tests.helpers.launchlib import launch, read_log, run_dir

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]
SLOW = os.path.join(launchlib.REPO, "tests", "helpers", "slow_example.py")
ARGS = ("--updates", "12", "--save-every", "1000")  # save_every far beyond the run: only preemption saves
MEMORY = ("--memory-tier", "--persist-every", "1000")
PREEMPTED_LINE = re.compile(r"preempted: saved (gen-\d+) at update (\d+) in [\d.]+ s")


def newest_start(root: str) -> str | None:
    try:
        directory = os.path.join(run_dir(root), STARTS_DIR)
        starts = sorted(os.listdir(directory))
    except OSError:
        return None
    return os.path.join(directory, starts[-1]) if starts else None


def reached(root: str) -> int:
    """The highest update any rank of the newest start marked (-1 before any)."""
    start = newest_start(root)
    return max((m.update for m in marks.read_marks(start).values()), default=-1) if start else -1


def committed(root: str) -> list[str]:
    try:
        path = run_dir(root)
        return [g for g in list_generations(LocalStore(path))
                if os.path.exists(os.path.join(path, g, MANIFEST_NAME))]
    except (OSError, ValueError):
        return []


def start_launcher(root: str, log: str, *launcher_args: str,
                   script_args: tuple[str, ...]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(launchlib.command(root, *launcher_args, script=SLOW, script_args=script_args),
                                cwd=launchlib.REPO, env=launchlib.env(), stdout=out, stderr=subprocess.STDOUT)


# how the notice came changes nothing after the preemption save: the resume to the end runs
# once per tier (RESUMED), the other ways stop at the validated save
RESUMED = {"sigterm", "sigterm-memory"}


@pytest.mark.long(reason="a slowed job preempted mid-run, then resumed to its end: two launches "
                         "and the suite's uninterrupted run")
@pytest.mark.parametrize("how", [
    pytest.param("sigterm", marks=pytest.mark.full_chain(
        reason="SIGTERM forwarded by the agent to interpreter workers, which save and exit 75 as "
               "torchrun's handler of interpreter workers reports it")),
    "usr1", "stop-file", "sigterm-memory"])
def test_preemption_saves_the_update_reached_and_resumes_bitwise(tmp_path, how: str) -> None:
    root, log, stop_file = str(tmp_path / "root"), str(tmp_path / "launcher.log"), tmp_path / "STOP"
    run_id = f"t-{uuid.uuid4().hex[:10]}"  # its own shared-memory directory for the memory tier
    common = ("--run-id", run_id, "--stop-file", str(stop_file), "--backoff", "0")
    extra = MEMORY if how == "sigterm-memory" else ()
    signals = ("--preempt-signal", "USR1") if how == "usr1" else ()
    proc = start_launcher(root, log, *common, *signals, "--grace", "120",
                          script_args=("0.5", *ARGS, *extra))
    try:
        launchlib.wait_for(lambda: reached(root) >= 2, 180, "update 2")
        at_signal = reached(root)
        if how == "stop-file":
            stop_file.touch()
        else:
            proc.send_signal(signal.SIGUSR1 if how == "usr1" else signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        proc.kill()
    output = open(log).read()
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    (start,) = read_log(root)
    assert start["classification"] == "preempted", start
    # torch logs the workers' exit 75 as a failure: the line says it is the expected one
    assert all("[expected: exit 75" in line for line in output.splitlines() if "(exitcode: 75)" in line)
    found = PREEMPTED_LINE.search(output)
    assert found is not None, output[-3000:]
    name, update = found.group(1), int(found.group(2))
    # the update in progress at the signal, plus one: the first rank to see the notice proposes
    # the call after the one it is at (a peer may already be past that one); +1 more for a
    # notice seen just after a call (the launcher and the workers poll)
    assert at_signal + 1 <= update <= at_signal + 3, (at_signal, update)
    reports = runinfo.read_reports(newest_start(root))
    assert any(r.get("preempted") == name and r.get("preempted_update") == update for r in reports.values())
    assert committed(root) == [name], "not on the root after the launcher exited"
    validate(LocalStore(run_dir(root)), name)
    if how not in RESUMED:
        return
    reference = launchlib.uninterrupted(12)  # the checkpoint tier does not change the arithmetic
    stop_file.unlink(missing_ok=True)
    resumed = launch(root, *common, script_args=(*ARGS, *extra, "--dump-final", str(tmp_path / "final.pt")))
    assert resumed.returncode == 0, resumed.output[-3000:]
    (after,) = resumed.starts
    assert (after["resumed_from"], after["classification"]) == (name, "done")
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert reference.keys() == final.keys() and len(final) > 4
    assert all(torch.equal(reference[k], final[k]) for k in reference), "resumed run diverged"


def test_second_sigterm_ends_at_once_and_committed_generations_stay_valid(tmp_path) -> None:
    root, log = str(tmp_path / "root"), str(tmp_path / "launcher.log")
    # updates of 2 s: the second SIGTERM lands long before the preemption's save
    proc = start_launcher(root, log, "--grace", "300", "--backoff", "0",
                          script_args=("2", "--updates", "1000", "--save-every", "1"))
    try:
        launchlib.wait_for(lambda: len(committed(root)) >= 2, 180, "two committed generations")
        proc.send_signal(signal.SIGTERM)
        launchlib.wait_for(lambda: os.path.exists(os.path.join(newest_start(root), PREEMPT_NOTICE_NAME)),
                           30, "the preemption notice")
        proc.send_signal(signal.SIGTERM)
        second = time.monotonic()
        proc.wait(timeout=120)
        ended_s = time.monotonic() - second
    finally:
        proc.kill()
    output = open(log).read()
    assert "a second preemption request; ending the workers now" in output, output[-3000:]
    assert ended_s < 60, f"the second SIGTERM took {ended_s:.1f} s to end the start (grace 300 s)"
    assert proc.returncode in (PREEMPTED_EXIT, 4), output[-3000:]
    pids = list(launchlib.worker_pids(root).values())
    launchlib.wait_for(lambda: launchlib.all_exited(pids), 30, "the workers to exit")
    generations = committed(root)
    assert len(generations) >= 2
    for name in generations:
        validate(LocalStore(run_dir(root)), name)


def test_preemption_before_the_first_start_starts_nothing(tmp_path) -> None:
    stop_file = tmp_path / "STOP"
    stop_file.touch()
    result = launch(str(tmp_path / "root"), "--stop-file", str(stop_file), script_args=ARGS)
    assert result.returncode == PREEMPTED_EXIT, result.output[-3000:]
    assert result.starts == [] and "preempted before start 1" in result.output


@pytest.mark.long(reason="three launches of fresh interpreters importing torch (a finished run, then two "
                         "starts that crash at the same update) before the launcher gives up")
def test_crash_loop_stops_after_two_starts_without_progress(tmp_path) -> None:
    root = str(tmp_path)
    first = launch(root, script_args=("--updates", "12", "--save-every", "4", "--stop-at", "4"))
    assert first.returncode == 0 and first.starts[0]["classification"] == "finished", first.output[-3000:]
    looping = launch(root, "--max-starts", "10", "--backoff", "0", script_args=(
        "--updates", "12", "--save-every", "4", "--crash-at", "6", "--crash-rank", "0"))  # no marker:
    # crashes every time; rank 0, so that its SIGKILL is the failure torchrun reports first (a
    # forked worker start reports only the lowest failed rank, tests/helpers/launchlib.py)
    assert looping.returncode == 3, looping.output[-3000:]
    assert [(s["start"], s["resumed_from"]) for s in looping.starts] == [(1, "gen-000000000004"),
                                                                        (2, "gen-000000000004")]
    assert all(s["classification"] == "transient" for s in looping.starts)
    assert "crash loop at update 4" in looping.output and "killed by SIGKILL" in looping.output


def test_missing_mirror_bucket_is_permanent_before_any_worker(tmp_path, s3_endpoint) -> None:
    root = str(tmp_path)
    result = launch(root, "--mirror", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}", script_args=ARGS)
    assert result.returncode == 1, result.output[-3000:]
    (start,) = result.starts
    assert start["classification"] == "permanent" and "does not answer" in start["reason"], start
    assert "no such bucket" in start["reason"]
    assert not os.path.exists(os.path.join(run_dir(root), STARTS_DIR)) or not os.listdir(
        os.path.join(run_dir(root), STARTS_DIR)), "a worker started"
