"""Retention across a run: last K, milestones and pins, from the manager and from the CLI."""

from __future__ import annotations

import json
import os

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, ValidationError
from dist_ckpt.cli.app import main as cli
from tests.helpers.local_jobs import make_state, step


def committed(root: str) -> list[int]:
    return sorted(int(n[4:]) for n in os.listdir(root) if n.startswith("gen-"))


def test_manager_keeps_last_milestones_and_pins(tmp_path) -> None:
    root = str(tmp_path)
    state = make_state()
    config = CheckpointConfig(root=root, keep_last=2, keep_every=3)
    with CheckpointManager(config, state) as mgr:
        step(state)
        mgr.save(1)
        assert mgr.pin("gen-000000000001", "best") == {"gen-000000000001": "best"}
        with pytest.raises(ValidationError, match="not a committed generation"):
            mgr.pin("gen-000000000099")
        for update in range(2, 8):
            step(state)
            mgr.save(update)
            mgr.pruner.settle()  # the prune queued by this save ran
    # newest two (6, 7), milestones (3, 6) and the pinned best (1)
    assert committed(root) == [1, 3, 6, 7]


def test_cli_pin_ls_and_prune(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        for update in range(1, 7):
            step(state)
            mgr.save(update)
    assert cli(["pin", root, "gen-000000000002", "--label", "final"]) == 0
    assert cli(["pin", root, "gen-000000000099"]) == 2  # no such generation
    assert cli(["pin", root, "../gen-000000000002"]) == 2
    capsys.readouterr()
    assert cli(["ls", root]) == 0
    listing = capsys.readouterr().out
    assert "PIN" in listing and "final" in listing
    assert cli(["ls", root, "--json"]) == 0
    pins = {g["name"]: g["pin"] for g in json.loads(capsys.readouterr().out)["generations"]}
    assert pins["gen-000000000002"] == "final" and pins["gen-000000000003"] is None
    assert cli(["prune", root, "--keep-last", "1", "--keep-every", "4", "--dry-run"]) == 0
    assert committed(root) == [1, 2, 3, 4, 5, 6]
    assert cli(["prune", root, "--keep-last", "1", "--keep-every", "4"]) == 0
    assert committed(root) == [2, 4, 6]
    assert cli(["unpin", root, "gen-000000000002"]) == 0
    assert cli(["prune", root, "--keep-last", "1", "--keep-every", "0"]) == 2
    assert cli(["prune", root, "--keep-last", "1"]) == 0
    assert committed(root) == [6]


def test_corrupt_pins_file_deletes_nothing(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path)
    state = make_state()
    with open(os.path.join(root, "pins.json"), "w") as handle:
        handle.write('{"pins": {"../escape": "x"}}')
    with CheckpointManager(CheckpointConfig(root=root, keep_last=1), state) as mgr:
        for update in (1, 2, 3):
            step(state)
            mgr.save(update)
            mgr.pruner.settle()
    assert committed(root) == [1, 2, 3]
    assert "local retention pass failed" in caplog.text
    assert cli(["prune", root, "--keep-last", "1"]) == 1
    assert committed(root) == [1, 2, 3]


def test_pins_reach_the_mirror(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "local")
    state = make_state()
    config = CheckpointConfig(root=root, mirror=s3_root, mirror_queue=4)  # nothing skipped
    with CheckpointManager(config, state) as mgr:
        for update in (1, 2, 3):
            step(state)
            mgr.save(update)
        mgr.wait()
        assert mgr.replayer is not None and mgr.replayer.drain(60)
        mgr.pin("gen-000000000001", "best")
    # an operator's prune of the mirror alone keeps what the job pinned
    assert cli(["prune", s3_root, "--keep-last", "1"]) == 0
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        assert [g.name for g in mgr.generations() if g.state == "committed"] == [
            "gen-000000000003", "gen-000000000001"]


def test_a_job_prune_takes_a_generation_out_at_once_and_deletes_its_files_later(tmp_path) -> None:
    # issue 37: wait() settles retention; deleting a large generation's files is the kernel's
    # slow part, so the job's pass renames the generation to a pending name (no generation any
    # more, as a crash's leftover attempt) and hands the deletion to a thread nobody waits for
    from dist_ckpt.lifecycle import retention
    from dist_ckpt.tiers import open_tier

    root = str(tmp_path)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        for update in (1, 2, 3):
            step(state)
            mgr.save(update)
    deferred: list = []
    removals = retention.prune(open_tier(root), keep_last=1, defer=deferred.append)
    assert sorted(removals.generations) == ["gen-000000000001", "gen-000000000002"]
    assert committed(root) == [3] and len(deferred) == 2
    aside = sorted(n for n in os.listdir(root) if n.startswith(".pending-"))
    assert [n.split("-pruned-")[0] for n in aside] == [
        ".pending-gen-000000000001", ".pending-gen-000000000002"]
    assert not any(os.path.exists(os.path.join(root, n, "manifest.json")) for n in aside)
    for discard in deferred:
        discard()
    assert not any(n.startswith(".pending-") for n in os.listdir(root))
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000003"
