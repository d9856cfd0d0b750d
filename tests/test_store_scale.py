"""Issue 41 on real processes: what the c10d store serves per save and while idle does not
grow per rank with the world size (nodes of two ranks, as torchrun describes them)."""

from __future__ import annotations

import pytest

from dist_ckpt.testing import run_ranks
from tests.helpers import store_traffic


@pytest.mark.processes
def test_store_reads_per_rank_do_not_grow_with_the_world_and_idle_ranks_are_silent(tmp_path) -> None:
    reads: dict[int, int] = {}
    for world in (4, 12):
        ranks = run_ranks(world, store_traffic.save_and_idle, str(tmp_path / f"w{world}"), 2,
                          timeout_s=120)
        # after the first save (it plans, and sends every write result in full)
        later = [max(r["per_save"][1][1], r["per_save"][2][1]) for r in ranks]
        reads[world] = max(later[1:])  # rank 0 reads every node's key: O(W) by design
        for rank, result in enumerate(ranks):
            if not result["leader"]:
                # a node's other ranks read the outcome from the node directory
                assert later[rank] <= 4096, (world, rank, later[rank])
                assert result["idle_requests"] == 0, (world, rank, result)
            else:
                assert result["idle_requests"] <= 3, (world, rank, result)  # the bell, 1/s
    assert reads[12] <= 1.5 * reads[4], reads


def test_gloo_groups_are_created_lazy_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: a full mesh of W ranks at the checkpoint group's creation is O(W²)
    connections; torch reads ``TORCH_GLOO_LAZY_INIT`` when a group is created."""
    import os

    from dist_ckpt.protocol.comm import GLOO_LAZY_ENV, lazy_gloo

    monkeypatch.delenv(GLOO_LAZY_ENV, raising=False)
    with lazy_gloo():
        assert os.environ[GLOO_LAZY_ENV] == "1"
    assert GLOO_LAZY_ENV not in os.environ  # the user's other groups: torch's default
    monkeypatch.setenv(GLOO_LAZY_ENV, "0")
    with lazy_gloo():
        assert os.environ[GLOO_LAZY_ENV] == "0"
    assert os.environ[GLOO_LAZY_ENV] == "0"
