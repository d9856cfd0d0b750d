"""``python -m launch``: restarts, exit classification, DONE, stop signals, run directories.

Every test runs real torchrun jobs (2 or 3 gloo ranks) of ``scripts/train_example.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from dist_ckpt.restart.contract import digest
from dist_ckpt.testing import tree_digest
from launch.options import parse
from launch.rundir import choose_run
from tests.helpers import launchlib
from tests.helpers.launchlib import launch, read_log, run_dir

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]
CRASH_JOB = os.path.join(launchlib.REPO, "tests", "helpers", "crash_job.py")


@pytest.mark.full_chain(reason="torchrun's handler of interpreter workers reports every failed rank, a "
                               "SIGKILLed one by its signal: the forked start reports only the first")
def test_sigkilled_worker_restarts_and_finishes_bitwise(tmp_path) -> None:
    args = ("--updates", "12", "--save-every", "4")
    root = str(tmp_path / "root")
    crashed = launch(root, "--backoff", "0.5", script_args=(
        *args, "--crash-at", "6", "--crash-marker", str(tmp_path / "crashed"),
        "--dump-final", str(tmp_path / "final.pt")))
    assert crashed.returncode == 0, crashed.output[-3000:]
    first, second = crashed.starts
    assert first["classification"] == "transient" and "rank 1 killed by SIGKILL" in first["reason"]
    assert first["resumed_from"] == "fresh"
    assert second["classification"] == "done"
    assert second["resumed_from"] == "gen-000000000004" and second["resumed_update"] == 4
    done = json.load(open(os.path.join(run_dir(root), "DONE.json")))
    assert done["generation"] == "gen-000000000012" and done["tokens_seen"] == 12 * 8 * 2
    expected = launchlib.uninterrupted(12)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert expected.keys() == final.keys() and len(final) > 4
    assert all(torch.equal(expected[k], final[k]) for k in expected), "resumed run diverged"


def test_contract_mismatch_is_permanent(tmp_path) -> None:
    root = str(tmp_path)
    first = launch(root, script_args=("--updates", "8", "--save-every", "4", "--stop-at", "4"))
    assert first.returncode == 0 and first.starts[0]["classification"] == "finished", first.output[-3000:]
    changed = launch(root, "--backoff", "0", script_args=("--updates", "8", "--width", "48"))
    assert changed.returncode == 1, changed.output[-3000:]
    assert len(changed.starts) == 1
    start = changed.starts[0]
    assert start["classification"] == "permanent" and "ContractMismatch" in start["reason"]
    assert "permanent: rank" in changed.output and "ContractMismatch" in changed.output


@pytest.mark.full_chain(reason="SIGINT reaches interpreter workers through the agent's Popen handles, "
                               "each worker in the session torchrun gave it")
def test_sigint_stops_at_once(tmp_path) -> None:
    """SIGINT is forwarded to the workers, which stop without saving. SIGTERM and the stop file
    preempt instead: tests/test_launch_preempt.py."""
    root, signals = str(tmp_path / "root"), tmp_path / "signals"
    signals.mkdir()
    proc = subprocess.Popen(
        launchlib.command(root, "--stop-file", str(tmp_path / "STOP"), "--backoff", "0", script_args=(
            "--updates", "1000000", "--save-every", "100000", "--signal-dir", str(signals))),
        cwd=launchlib.REPO, env=launchlib.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        launchlib.wait_for(lambda: launchlib.workers_training(root, 2), 120, "both ranks to start")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 4, output[-3000:]
    starts = read_log(root)
    assert len(starts) == 1 and starts[0]["classification"] == "stopped"
    assert "SIGINT received" in starts[0]["reason"]
    assert sorted(os.listdir(signals)) == ["signal-rank0", "signal-rank1"]
    assert {(signals / name).read_text() for name in os.listdir(signals)} == {str(int(signal.SIGINT))}


def test_max_starts_with_backoff(tmp_path) -> None:
    root = str(tmp_path)
    result = launch(root, "--max-starts", "2", "--backoff", "1.5", script=CRASH_JOB)
    assert result.returncode == 3, result.output[-3000:]
    assert [s["start"] for s in result.starts] == [1, 2]
    assert all(s["classification"] == "transient" and "exited 3" in s["reason"] for s in result.starts)
    first, second = result.starts
    waited = second["began_unix"] - (first["began_unix"] + first["duration_s"])
    assert waited >= 1.5, f"backoff not honoured: started again after {waited:.2f} s"
    assert second["backoff_s"] == 1.5
    assert "gave up after 2 starts" in result.output and "start  world" in result.output


def test_too_little_free_space_is_permanent(tmp_path) -> None:
    result = launch(str(tmp_path), "--min-free-bytes", "1000000T")
    assert result.returncode == 1
    assert len(result.starts) == 1 and "insufficient space" in result.starts[0]["reason"]
    assert result.starts[0]["classification"] == "permanent"


@pytest.mark.long(reason="two launches of fresh interpreters importing torch, at 2 and then 3 workers: "
                         "five workers on two cores")
def test_world_size_change_consumes_every_sample_once(tmp_path) -> None:
    root, samples = str(tmp_path / "root"), tmp_path / "samples"
    samples.mkdir()
    common = ("--updates", "12", "--save-every", "3", "--record-samples", str(samples))
    two = launch(root, nproc=2, script_args=(*common, "--stop-at", "6"))
    assert two.returncode == 0 and two.starts[0]["classification"] == "finished", two.output[-3000:]
    three = launch(root, nproc=3, script_args=common)
    assert three.returncode == 0, three.output[-3000:]
    assert three.starts[0]["resumed_from"] == "gen-000000000006"
    assert three.starts[0]["world_size"] == 3 and three.starts[0]["classification"] == "done"
    consumed: dict[int, list[int]] = {}
    for name in os.listdir(samples):
        for line in open(samples / name):
            record = json.loads(line)
            consumed.setdefault(record["update"], []).extend(record["indices"])
    assert sorted(consumed) == list(range(12))
    every = [i for update in range(12) for i in consumed[update]]
    assert len(every) == 6 * 8 * 2 + 6 * 8 * 3
    assert len(set(every)) == len(every), "a sample was consumed twice"
    # the tokens seen are the samples consumed, across the change of world size
    done = json.load(open(os.path.join(run_dir(root), "DONE.json")))
    assert done["tokens_seen"] == len(every) == 6 * 8 * 2 + 6 * 8 * 3, done


def test_stale_done_ignored_and_abort_after_done_is_done(tmp_path) -> None:
    root = str(tmp_path / "root")
    stale = os.path.join(root, "runs", "0001")
    os.makedirs(stale)
    with open(os.path.join(root, "current"), "w") as handle:
        handle.write("0001\n")
    with open(os.path.join(stale, "DONE.json"), "w") as handle:
        json.dump({"format_version": 1, "run_id": "0001", "generation": "gen-000000000008",
                   "next_update": 8, "manifest_sha256": "0" * 64,
                   "contract_digest": digest({"config": "another experiment"}), "tokens_seen": 1,
                   "world_size": 2, "finished_unix": 0.0, "dist_ckpt_version": "0.1.0"}, handle)
    result = launch(root, "--backoff", "0.5", script_args=(
        "--updates", "8", "--save-every", "4", "--crash-at", "2",
        "--crash-marker", str(tmp_path / "crashed"), "--abort-after-finish"))
    assert result.returncode == 0, result.output[-3000:]
    first, second = result.starts
    assert first["classification"] == "transient", "a stale DONE ended a new run"
    assert second["classification"] == "done"
    assert second["exit_codes"].get("1") == -signal.SIGABRT, second
    done = json.load(open(os.path.join(stale, "DONE.json")))
    assert done["generation"] == "gen-000000000008" and done["manifest_sha256"] != "0" * 64


def test_fresh_keeps_the_earlier_run(tmp_path) -> None:
    root = str(tmp_path)
    first = launch(root, script_args=("--updates", "4", "--save-every", "2"))
    assert first.returncode == 0, first.output[-3000:]
    earlier = run_dir(root)
    before = tree_digest(earlier)
    fresh = launch(root, "--fresh", script_args=("--updates", "4", "--save-every", "2"))
    assert fresh.returncode == 0, fresh.output[-3000:]
    assert fresh.starts[0]["resumed_from"] == "fresh" and fresh.starts[0]["run_id"] == "0002"
    assert run_dir(root) != earlier and tree_digest(earlier) == before
    # without --fresh the active run continues
    assert choose_run(root, fresh=False, run_id=None)[:2] == ("0002", run_dir(root))


def test_torchrun_options_are_forwarded_unchanged() -> None:
    options = parse(["--nnodes", "2", "--checkpoint-root", "/r", "--node-rank", "1",
                     "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
                     "--rdzv-id", "job7", "--max-restarts", "2", "--backoff", "1,2",
                     "train.py", "--fresh", "--lr", "3"])
    assert options.torchrun_argv == ["--max-restarts", "0", "--nnodes", "2", "--node-rank", "1",
                                     "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400",
                                     "--rdzv-id", "job7", "train.py", "--fresh", "--lr", "3"]
    assert options.max_starts == 3 and options.backoff_s == [1.0, 2.0] and not options.fresh
    assert options.stop_file == "/r/STOP" and options.torchrun.max_restarts == 0
    with pytest.raises(SystemExit):
        parse(["--nproc-per-node", "2", "train.py"])  # --checkpoint-root is required


def test_console_script_is_installed() -> None:
    runner = os.path.join(os.path.dirname(sys.executable), "dist-ckpt-run")
    out = subprocess.run([runner, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--checkpoint-root" in out.stdout and "--nproc-per-node" in out.stdout
    assert out.stdout.startswith("usage: dist-ckpt-run ")
