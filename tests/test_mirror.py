"""The mirror tier: only completed uploads count as remotely durable."""

from __future__ import annotations

import json
import os
import shutil

import torch

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.cli.app import main as cli
from dist_ckpt.replay.record import read_mirror_state
from tests.helpers.local_jobs import make_state, step
from tests.helpers.mirror_runs import remote_states, run_job


def test_mirror_round_trip_after_local_loss(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "local")
    state = make_state()
    config = CheckpointConfig(root=root, mirror=s3_root)
    with CheckpointManager(config, state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
    saved = {k: v.clone() for k, v in state.model.state_dict().items()}
    assert read_mirror_state(root)["last_completed"] == "gen-000000000002"
    assert remote_states(s3_root) == {"gen-000000000001": "committed", "gen-000000000002": "committed"}
    shutil.rmtree(root)  # a replaced machine: the local tier is gone
    fresh = make_state()
    with CheckpointManager(config, fresh) as mgr:
        result = mgr.restore()
    assert result.generation == "gen-000000000002"
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, saved[key])


def test_retention_per_tier(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "local")
    state = make_state()
    config = CheckpointConfig(root=root, mirror=s3_root, keep_last=2, mirror_keep_last=3)
    with CheckpointManager(config, state) as mgr:
        for update in range(1, 6):
            step(state)
            mgr.save(update)
            assert mgr.replayer.drain(60)  # no skipping: every generation reaches the mirror
    local = sorted(n for n in os.listdir(root) if n.startswith("gen-"))
    assert local == ["gen-000000000004", "gen-000000000005"]
    assert sorted(remote_states(s3_root)) == [f"gen-{n:012d}" for n in (3, 4, 5)]


def test_mirror_lag_skips_intermediate_generations(s3_root: str, tmp_path, capsys) -> None:
    root = str(tmp_path / "local")
    # the first upload is held until the job's last save returned: no delay has to be long enough
    proc = run_job(root, s3_root, list(range(1, 9)), {"mirror.upload": {"block": "uploads"}},
                   hold="uploads")
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["saves_while_held"]  # every local save returned while the mirror was stuck
    assert figures["max_uploading"] == 1 and figures["max_queue"] <= 2
    assert figures["skipped"], "the mirror never fell behind"
    assert figures["completed"][-1] == "gen-000000000008"  # the newest always goes up
    assert not set(figures["skipped"]) & set(figures["completed"])
    capsys.readouterr()
    assert cli(["ls", root, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    marks = {g["name"]: g.get("mirror") for g in listing["generations"]}
    for name in figures["skipped"]:
        assert marks[name] == "local-only (skipped)"
    for name in figures["completed"]:
        assert marks[name] == "mirrored"
    assert listing["mirror"]["last_completed"] == "gen-000000000008"
