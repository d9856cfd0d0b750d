"""The launcher and the memory tier: a SIGKILLed worker resumes from memory (no generation on
disk yet) and finishes bitwise equal to an uninterrupted run; nothing of a run stays in shared
memory after DONE, or after a killed launcher once the next one started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from dist_ckpt.format.validate import list_generations
from dist_ckpt.memory import paths as shm
from dist_ckpt.storage.local import LocalStore
from launch import memory_dir
from tests.helpers import launchlib
from tests.helpers.launchlib import launch, run_dir

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]
MEMORY = ("--memory-tier", "--persist-every", "100", "--updates", "12", "--save-every", "1")


def test_sigkilled_worker_resumes_from_memory_bitwise(tmp_path) -> None:
    """Real shared memory (the test's own base in /dev/shm). persist_every=100: until
    finish() the root holds no generation at all, so resuming at update 5 proves that
    nothing was read from storage."""
    run_id = f"t-{uuid.uuid4().hex[:10]}"
    launchlib.reference(str(tmp_path / "reference"), *MEMORY, "--dump-final", str(tmp_path / "reference.pt"))
    root = str(tmp_path / "root")
    crashed = launch(root, "--run-id", run_id, "--backoff", "0.5", script_args=(
        *MEMORY, "--crash-at", "6", "--crash-marker", str(tmp_path / "crashed"),
        "--dump-final", str(tmp_path / "final.pt")))
    assert crashed.returncode == 0, crashed.output[-3000:]
    first, second = crashed.starts
    assert first["classification"] == "transient" and "SIGKILL" in first["reason"]
    assert first["memory_bytes"] > 0
    assert second["classification"] == "done"
    assert (second["resumed_from"], second["resumed_tier"]) == ("gen-000000000005", "memory")
    assert "resumed from gen-000000000005 (memory tier)" in crashed.output
    assert list_generations(LocalStore(run_dir(root))) == ["gen-000000000012"]
    assert json.load(open(os.path.join(run_dir(root), "DONE.json")))["generation"] == "gen-000000000012"
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert expected.keys() == final.keys() and len(final) > 4
    assert all(torch.equal(expected[k], final[k]) for k in expected), "resumed run diverged"
    assert not os.path.exists(shm.run_dir(run_id, shm.base_dir()))  # removed at DONE


def test_killed_launcher_memory_is_removed_by_the_next_start(tmp_path) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    env = dict(launchlib.env(), **{shm.SHM_DIR_ENV: str(shm_dir)})
    root = str(tmp_path / "root")
    proc = subprocess.Popen(
        launchlib.command(root, "--run-id", "killed", script_args=(
            "--memory-tier", "--updates", "1000000", "--save-every", "1", "--persist-every", "1000")),
        cwd=launchlib.REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = shm.run_dir("killed", str(shm_dir))
    try:
        launchlib.wait_for(lambda: launchlib.workers_training(root, 2), 120, "both ranks to start")
        launchlib.wait_for(lambda: any(d.startswith("gen-") for _, dirs, _ in os.walk(killed)
                                       for d in dirs), 60, "an in-memory generation")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    pids = list(launchlib.worker_pids(root).values())
    launchlib.wait_for(lambda: launchlib.all_exited(pids), 60, "the orphaned workers to exit")
    assert os.path.isdir(killed) and memory_dir.stale_reason(killed) is not None
    after = subprocess.run(launchlib.command(str(tmp_path / "next"), "--run-id", "next", script_args=(
        "--memory-tier", "--updates", "2", "--save-every", "1")), cwd=launchlib.REPO, env=env,
        capture_output=True, text=True, timeout=240)
    assert after.returncode == 0, after.stderr[-3000:]
    assert f"removed stale in-memory checkpoints {killed}" in after.stderr
    assert os.listdir(shm_dir) == [], "no directory of either run remains"


def test_stale_detection_only_removes_provably_dead_owners(tmp_path) -> None:
    base = str(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    gone_pid = int(dead.stdout)
    for run, owner in (("dead", {"pid": gone_pid}), ("alive", {"pid": os.getpid()}),
                       ("elsewhere", {"pid": gone_pid, "host": "another-host"})):
        directory = memory_dir.claim(run, base)
        record = json.load(open(os.path.join(directory, memory_dir.OWNER_NAME)))
        record.update(owner)
        with open(os.path.join(directory, memory_dir.OWNER_NAME), "w") as handle:
            json.dump(record, handle)
    os.makedirs(os.path.join(base, f"{shm.PREFIX}ownerless"))
    os.makedirs(os.path.join(base, "unrelated"))
    assert memory_dir.remove_stale(base) == [shm.run_dir("dead", base)]
    assert sorted(os.listdir(base)) == sorted(f"{shm.PREFIX}{n}" for n in
                                              ("alive", "elsewhere", "ownerless")) + ["unrelated"]
    with open(os.path.join(shm.run_dir("alive", base), "blob"), "wb") as handle:
        handle.write(b"x" * 1000)
    assert memory_dir.used_bytes("alive", base) >= 1000
    assert memory_dir.remove_run("alive", base) and not os.path.exists(shm.run_dir("alive", base))
