"""Resharded restarts: loaded tensors equal the saved ones bitwise; data consumed exactly once."""

from __future__ import annotations

import pytest
import torch

from dist_ckpt.testing import run_ranks
from tests import workers

STEPS = 6


def check_restart(saved: dict, loaded: list[dict], old_world: int, steps: int = STEPS) -> None:
    full = loaded[0]["full"]
    assert saved["full"].keys() == full.keys()
    for key, tensor in saved["full"].items():
        assert torch.equal(tensor, full[key]), f"{key} differs after resharding"
    for rank_result in loaded:
        assert rank_result["generation"] == f"gen-{steps:012d}"
        assert rank_result["next_update"] == steps
    consumed = [i for batch in saved["batches"] for i in batch]
    remaining = [i for r in loaded for i in r["remaining"]]
    assert len(remaining) == len(set(remaining)), "a sample was handed out twice"
    assert len(consumed) * old_world + len(remaining) == workers.NUM_SAMPLES
    assert not set(remaining) & set(consumed)


def test_fsdp_two_to_three_and_one(tmp_path) -> None:
    root = str(tmp_path / "run")
    saved = run_ranks(2, workers.save_for_reshard, "fsdp", root, STEPS)
    all_consumed = {i for r in saved for b in r["batches"] for i in b}
    for new_world in (3, 1):
        loaded = run_ranks(new_world, workers.load_resharded, "fsdp", root)
        check_restart(saved[0], loaded, old_world=2)
        remaining = {i for r in loaded for i in r["remaining"]}
        assert remaining | all_consumed == set(range(workers.NUM_SAMPLES))


@pytest.mark.parametrize("kinds", [("fsdp", "fsdp"), ("ddp", "fsdp")])
def test_four_to_two(kinds: tuple[str, str], tmp_path) -> None:
    root = str(tmp_path / "run")
    steps = 3  # 4 ranks x 3 updates leave half of the epoch to consume after the restart
    saved = run_ranks(4, workers.save_for_reshard, kinds[0], root, steps)
    loaded = run_ranks(2, workers.load_resharded, kinds[1], root)
    check_restart(saved[0], loaded, old_world=4, steps=steps)
