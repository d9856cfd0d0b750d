"""CUDA-only checks: pinned staging, CUDA RNG capture, bitwise restore of CUDA tensors.

Skipped where no CUDA device exists (this is the only place skips are allowed).
"""

from __future__ import annotations

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.save.staging import StagingPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_staging_of_cuda_tensors_is_pinned_and_reused() -> None:
    pool = StagingPool(1)
    slot = pool.acquire()
    source = {"w": torch.randn(1024, 1024, device="cuda")}
    staged = slot.stage(source)
    assert staged["w"].is_pinned() and staged["w"].device.type == "cpu"
    assert torch.equal(staged["w"], source["w"].cpu())
    first = staged["w"].data_ptr()
    source["w"].add_(1)
    again = slot.stage(source)
    assert again["w"].data_ptr() == first and pool.allocations == 1
    assert torch.equal(again["w"], source["w"].cpu())


def test_cuda_model_async_round_trip_with_cuda_rng(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = TrainState(model, optimizer)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path), async_save=True), state) as mgr:
        mgr.save(1)
    expected_draw = torch.rand(4, device="cuda")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    fresh = torch.nn.Linear(64, 64).cuda()
    fresh_state = TrainState(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1))
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), fresh_state) as mgr:
        assert mgr.restore().generation == "gen-000000000001"
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key])
    assert torch.equal(torch.rand(4, device="cuda"), expected_draw)
