"""Resharded restarts: loaded tensors equal the saved ones bitwise; data consumed exactly once."""

from __future__ import annotations

import pytest

from dist_ckpt.testing import run_ranks
from tests import workers
from tests.workers import check_restart

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
