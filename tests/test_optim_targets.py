"""A restarted process's optimizer gets its state as load targets allocated from the
generation's metadata, not from torch's zero-gradient optimizer step; anything the metadata
does not describe keeps torch's path; a failed load leaves the optimizer without state."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.testing import run_ranks
from tests.helpers import workers
from tests.helpers.workers import check_restart

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


def build(kind: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, OPTIMIZERS[kind](model.parameters())


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 8, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def no_fake_step(monkeypatch: Any) -> list[int]:
    """Count torch's zero-gradient initialisation steps (each fails the test where called)."""
    calls: list[int] = []
    init = torch_state_dict._init_optim_state

    def counting(optim: torch.optim.Optimizer) -> None:
        if not optim.state:
            calls.append(1)
        init(optim)

    monkeypatch.setattr(torch_state_dict, "_init_optim_state", counting)
    return calls


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_restart_loads_optimizer_state_without_a_fake_step(tmp_path, monkeypatch, kind: str) -> None:
    model, optimizer = build(kind, 0)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(model, optimizer)) as mgr:
        for seed in range(3):
            step(model, optimizer, seed)
        mgr.save(3)
    fresh_model, fresh_optimizer = build(kind, 1)
    fake_steps = no_fake_step(monkeypatch)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)),
                           TrainState(fresh_model, fresh_optimizer)) as mgr:
        assert mgr.restore().generation == "gen-000000000003"
    # every state entry created from the metadata, none by a zero-gradient step
    assert fake_steps == []
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys()
    for index, entries in saved["state"].items():
        assert entries.keys() == loaded["state"][index].keys()
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][index][name]))
            assert torch.as_tensor(value).dtype == torch.as_tensor(loaded["state"][index][name]).dtype
    # the next update is the same as the uninterrupted run's
    step(model, optimizer, 7)
    step(fresh_model, fresh_optimizer, 7)
    for before, after in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(before, after)


def test_a_stateless_optimizer_keeps_torchs_path(tmp_path, monkeypatch) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state saved
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(model, optimizer)) as mgr:
        step_once = model(torch.ones(1, 4)).sum()
        step_once.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mgr.save(1)
    fresh = torch.nn.Linear(4, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fake_steps = no_fake_step(monkeypatch)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(fresh, fresh_optimizer)) as mgr:
        assert mgr.restore().generation == "gen-000000000001"
    assert fake_steps  # nothing to allocate from: torch's own initialisation ran
    assert torch.equal(fresh.weight, model.weight)


def test_a_failed_load_leaves_the_optimizer_without_state(tmp_path) -> None:
    model, optimizer = build("adamw", 0)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(model, optimizer)) as mgr:
        step(model, optimizer, 0)
        mgr.save(1)
    shard = os.path.join(tmp_path, "gen-000000000001", "dcp", "__0_0.distcp")
    with open(shard, "r+b") as handle:  # one flipped bit: the generation fails its digest
        handle.seek(os.path.getsize(shard) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    fresh_model, fresh_optimizer = build("adamw", 1)
    initial = [p.detach().clone() for p in fresh_model.parameters()]
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)),
                           TrainState(fresh_model, fresh_optimizer)) as mgr:
        result = mgr.restore(on_all_rejected="fresh")
    assert result.generation is None and [r.generation for r in result.rejected] == ["gen-000000000001"]
    assert not fresh_optimizer.state  # a fresh start: no uninitialised targets left behind
    for before, after in zip(initial, fresh_model.parameters(), strict=True):
        assert torch.equal(before, after)


def load_without_fake_step(rank: int, world: int, kind: str, root: str) -> dict:
    fake_steps = no_fake_step(pytest.MonkeyPatch())
    out = workers.load_resharded(rank, world, kind, root)
    out["fake_steps"] = len(fake_steps)
    return out


@pytest.mark.processes
def test_fsdp_resharded_restart_allocates_sharded_targets(tmp_path) -> None:
    root = str(tmp_path / "run")
    saved = run_ranks(2, workers.save_for_reshard, "fsdp", root, 3)
    loaded = run_ranks(3, load_without_fake_step, "fsdp", root)
    check_restart(saved[0], loaded, old_world=2, steps=3)
    # full_state's own get_state_dict runs after the restore: the state exists by then
    assert [r["fake_steps"] for r in loaded] == [0, 0, 0]
