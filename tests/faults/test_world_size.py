"""Resharded restarts: loaded tensors equal the saved ones bitwise; data consumed exactly once."""

from __future__ import annotations

import pytest
import torch

from dist_ckpt.testing import run_ranks
from tests.helpers import workers
from tests.helpers.workers import check_restart

pytestmark = pytest.mark.processes

STEPS = 6


def test_fsdp_two_to_three_and_one(tmp_path) -> None:
    root = str(tmp_path / "run")
    saved = run_ranks(2, workers.save_for_reshard, "fsdp", root, STEPS)
    all_consumed = {i for r in saved for b in r["batches"] for i in b}
    for new_world in (3, 1):
        loaded = run_ranks(new_world, workers.load_resharded, "fsdp", root)
        check_restart(saved[0], loaded, old_world=2, steps=STEPS)
        remaining = {i for r in loaded for i in r["remaining"]}
        assert remaining | all_consumed == set(range(workers.NUM_SAMPLES))


@pytest.mark.parametrize("kinds", [("fsdp", "fsdp"), ("ddp", "fsdp")])
def test_four_to_two(kinds: tuple[str, str], tmp_path) -> None:
    root = str(tmp_path / "run")
    steps = 3  # 4 ranks x 3 updates leave half of the epoch to consume after the restart
    saved = run_ranks(4, workers.save_for_reshard, kinds[0], root, steps)
    loaded = run_ranks(2, workers.load_resharded, kinds[1], root)
    check_restart(saved[0], loaded, old_world=4, steps=steps)


def test_two_resharded_restores_continue_identically(tmp_path) -> None:
    """Ranks that did not exist at save time derive their streams from the saved ones
    deterministically: two restores of one generation take the same next update."""
    root = str(tmp_path / "run")
    run_ranks(2, workers.save_for_reshard, "fsdp", root, 4)
    first, second = (run_ranks(3, workers.resume_and_finish, "fsdp", 5, root, None) for _ in range(2))
    assert [r["generation"] for r in first] == ["gen-000000000004"] * 3
    assert [r["losses"] for r in first] == [r["losses"] for r in second]
    assert all(len(r["losses"]) == 1 for r in first)
    assert first[0]["final"].keys() == second[0]["final"].keys()
    assert all(torch.equal(first[0]["final"][k], second[0]["final"][k]) for k in first[0]["final"])
