"""The launcher and the memory tier: a SIGKILLed worker resumes from memory (no generation on
disk yet) and finishes bitwise equal to an uninterrupted run; nothing of a run stays in shared
memory after DONE; two jobs on one host each own their directory (issue 27, item 5), and a
stopped launcher persists memory's newest generation to the root before removing it (item 6).
The sweep of dead launchers' directories: tests/test_memory_owner.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid

import pytest
import torch

from dist_ckpt.format.validate import list_generations, validate
from dist_ckpt.launcher_api import CURRENT_NAME, STARTS_DIR
from dist_ckpt.memory import paths as shm
from dist_ckpt.storage.local import LocalStore
from launch import memory_dir
from tests.helpers import launchlib
from tests.helpers.launchlib import launch, run_dir

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600)]
SLOW = os.path.join(launchlib.REPO, "tests", "helpers", "slow_example.py")  # leaves the CPU to the other job
MEMORY = ("--memory-tier", "--persist-every", "100", "--updates", "12", "--save-every", "1")


def test_sigkilled_worker_resumes_from_memory_bitwise(tmp_path) -> None:
    """Real shared memory (the test's own base in /dev/shm). persist_every=100: until
    finish() the root holds no generation at all, so resuming at update 5 proves that
    nothing was read from storage."""
    run_id = f"t-{uuid.uuid4().hex[:10]}"
    root = str(tmp_path / "root")
    # rank 0 dies: its SIGKILL is the failure torchrun reports first however the workers started
    crashed = launch(root, "--run-id", run_id, "--backoff", "0.5", script_args=(
        *MEMORY, "--crash-at", "6", "--crash-rank", "0", "--crash-marker", str(tmp_path / "crashed"),
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
    expected = launchlib.uninterrupted(12)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert expected.keys() == final.keys() and len(final) > 4
    assert all(torch.equal(expected[k], final[k]) for k in expected), "resumed run diverged"
    assert not os.path.exists(shm.run_dir(run_id, run_dir(root)))  # removed at DONE


def _newest_start_resumed(root: str) -> list[str]:
    """The tiers the ranks of the current start resumed from, once every rank reported."""
    launch_dir = os.path.join(run_dir(root), STARTS_DIR)
    newest = os.path.join(launch_dir, sorted(os.listdir(launch_dir))[-1])
    reports = [json.load(open(os.path.join(newest, name))) for name in os.listdir(newest)
               if name.startswith("rank-")]
    return [str(r.get("resumed_tier")) for r in reports if "resumed_from" in r]


@pytest.mark.long(reason="two launchers side by side on one host, then a killed worker's restart and a last "
                         "start that fails: four starts of torchrun's agent and workers importing torch")
def test_two_jobs_on_one_host_each_own_a_directory_and_giving_up_persists_memory(tmp_path) -> None:
    """Two launchers on one host, both run 0001, different roots, one shared-memory base. The
    short job's launcher (one rank) removes only its own directory; a worker of the long job SIGKILLed
    after that still resumes from memory. When its last start fails too, the long job's launcher
    gives up and persists its newest in-memory generation (nothing reached the root:
    persist_every 1000) before removing it."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    env = dict(launchlib.env(), **{shm.SHM_DIR_ENV: str(shm_dir)})
    long_root, short_root = str(tmp_path / "long"), str(tmp_path / "short")
    log = open(tmp_path / "long.log", "w+")
    proc = subprocess.Popen(
        launchlib.command(long_root, "--backoff", "0.5", "--max-starts", "2", script=SLOW, script_args=(
            "0.2", "--memory-tier", "--updates", "1000000", "--save-every", "1", "--persist-every", "1000")),
        cwd=launchlib.REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def claimed() -> bool:
            return os.path.exists(os.path.join(long_root, CURRENT_NAME)) and os.path.exists(
                os.path.join(shm.run_dir("0001", run_dir(long_root), str(shm_dir)), memory_dir.OWNER_NAME))

        launchlib.wait_for(claimed, 60, "the long job's launcher to own its directory")
        long_dir = shm.run_dir("0001", run_dir(long_root), str(shm_dir))
        # while the long job's workers start: the short job runs to DONE and ends
        short = subprocess.run(launchlib.command(short_root, nproc=1, script_args=(
            "--memory-tier", "--updates", "2", "--save-every", "1")), cwd=launchlib.REPO, env=env,
            capture_output=True, text=True, timeout=240)
        assert short.returncode == 0, short.stderr[-3000:]
        short_dir = shm.run_dir("0001", run_dir(short_root), str(shm_dir))
        assert short_dir != long_dir
        assert short.stderr.strip().splitlines()[-1] == f"[launch] removed in-memory checkpoints {short_dir}"
        assert os.listdir(shm_dir) == [os.path.basename(long_dir)], "the long job's is untouched"
        launchlib.wait_for(lambda: any(d.startswith("gen-") for _, dirs, _ in os.walk(long_dir)
                                       for d in dirs), 120, "an in-memory generation")
        owner = json.load(open(os.path.join(long_dir, memory_dir.OWNER_NAME)))
        assert owner["pid"] == proc.pid and owner["root"] == run_dir(long_root)
        os.kill(launchlib.worker_pids(long_root)[1], signal.SIGKILL)
        launchlib.wait_for(lambda: len(launchlib.read_log(long_root)) == 1, 60, "the start to end")
        launchlib.wait_for(lambda: _newest_start_resumed(long_root) == ["memory", "memory"], 120,
                           "both ranks to resume from memory")
        os.kill(launchlib.worker_pids(long_root)[1], signal.SIGKILL)  # the last start fails too
        proc.wait(timeout=120)
    finally:
        proc.kill()
    log.seek(0)
    output = log.read()
    assert proc.returncode == 3, output[-3000:]  # gave up
    assert [s["classification"] for s in launchlib.read_log(long_root)] == ["transient"] * 2
    last = output.strip().splitlines()[-1]
    prefix, _, rest = last.partition(" from memory to ")
    assert prefix.startswith("[launch] persisted gen-"), output[-3000:]
    generation = prefix.removeprefix("[launch] persisted ")
    assert rest == f"{run_dir(long_root)} before removing in-memory checkpoints {long_dir}"
    validate(LocalStore(run_dir(long_root)), generation)  # digests too
    assert list_generations(LocalStore(run_dir(long_root))) == [generation]
    assert os.listdir(shm_dir) == [], "no directory of either job remains"
