"""Bitwise continuation on CPU at the same world size, with negative controls."""

from __future__ import annotations

import pytest
import torch

from dist_ckpt.testing import run_ranks
from tests.helpers import workers

pytestmark = pytest.mark.processes

STEPS = 8


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_bitwise_continuation_and_negative_controls(kind: str, tmp_path) -> None:
    roots = {str(tmp_path / "sync"): False, str(tmp_path / "async"): True}
    straight = run_ranks(2, workers.straight_and_half, kind, STEPS, roots)
    reference = straight[0]["final"]
    runs = run_ranks(2, _resume_variants, kind, list(roots))
    for root in roots:
        resumed = runs[0][root]
        assert resumed["generation"] == "gen-000000000004"
        for rank in range(2):
            rank_run = runs[rank][root]
            assert straight[rank]["losses"][STEPS // 2:] == rank_run["losses"], f"rank {rank} losses"
            assert straight[rank]["batches"][STEPS // 2:] == rank_run["batches"], f"rank {rank} batches"
        assert_same_state(reference, resumed["final"])
    controls = runs[0]["controls"]
    for missing, run in controls.items():
        same_losses = all(straight[r]["losses"][STEPS // 2:] == runs[r]["controls"][missing]["losses"]
                          for r in range(2))
        assert differs(reference, run["final"]) or not same_losses, f"without {missing} still equal"
    assert not all(straight[r]["batches"][STEPS // 2:] == runs[r]["controls"]["data"]["batches"]
                   for r in range(2)), "without the sampler state the batches must differ"
    assert differs(reference, controls["optimizer"]["final"])
    assert any(straight[r]["losses"][STEPS // 2:] != runs[r]["controls"]["rng"]["losses"]
               for r in range(2)), "without RNG the losses must differ"


def _resume_variants(rank: int, world: int, kind: str, roots: list[str]) -> dict:
    out = {root: workers.resume_and_finish(rank, world, kind, STEPS, root, None) for root in roots}
    everything = ["model", "optimizer", "scheduler", "data", "rng", "extras"]
    out["controls"] = {
        missing: workers.resume_and_finish(rank, world, kind, STEPS, roots[0],
                                           [c for c in everything if c != missing])
        for missing in ("optimizer", "rng", "data")
    }
    return out
