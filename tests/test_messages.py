"""What the library says: commit and restore log lines, a pointer to a missing generation,
GenerationExists that tells committed from present-but-invalid, extras that differ by rank."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, GenerationExists, RankMismatch
from dist_ckpt.testing import run_ranks
from tests.helpers.local_jobs import make_state, step, two_generations


def test_commit_and_restore_each_log_one_line(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dist_ckpt")
    root = str(tmp_path)
    two_generations(root)
    commits = [r.getMessage() for r in caplog.records if "committed gen-" in r.getMessage()]
    assert len(commits) == 2 and commits[1].startswith("[rank 0] committed gen-000000000002: ")
    assert "synchronous, durable after" in commits[1] and root in commits[1]
    caplog.clear()
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        mgr.restore()
    restored = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert restored == [f"[rank 0] restored gen-000000000002 (next_update 2) from {root} (local tier); "
                        "0 rejected"]


def test_latest_pointing_at_a_missing_generation_is_reported(tmp_path, caplog) -> None:
    root = str(tmp_path)
    two_generations(root)
    shutil.move(os.path.join(root, "gen-000000000002"), str(tmp_path.parent / "elsewhere"))
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        result = mgr.restore()
    assert result.generation == "gen-000000000001"
    assert result.warnings == [f"latest.json points at gen-000000000002, which is missing under {root}"]
    assert any("latest.json points at gen-000000000002" in r.getMessage() for r in caplog.records)


def test_generation_exists_says_committed_or_invalid(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        step(state)
        with pytest.raises(GenerationExists, match="gen-000000000002 is already committed"):
            mgr.save(2)
        shard = tmp_path / "gen-000000000001" / "state" / "train_state.json"
        shard.write_bytes(shard.read_bytes()[:-2])
        with pytest.raises(GenerationExists, match="present but invalid .*dist-ckpt quarantine"):
            mgr.save(1)


def differing_extras(rank: int, world: int, root: str) -> str:
    state = make_state()
    state.extras.update({"best_loss": 0.5, "tracker_step": 10 + rank, "run": "a"})
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        step(state)
        try:
            mgr.save(1)
        except RankMismatch as exc:
            return f"{sorted(exc.differences.items())}|{exc}"
    return "saved"


@pytest.mark.processes
def test_extras_that_differ_between_ranks_are_refused(tmp_path) -> None:
    outcomes = run_ranks(2, differing_extras, str(tmp_path))
    assert outcomes[0] == outcomes[1]
    differences, message = outcomes[0].split("|")
    assert differences == "[(1, ['tracker_step'])]"
    assert "rank 1: tracker_step" in message
    assert not any(name.startswith("gen-") for name in os.listdir(tmp_path))
