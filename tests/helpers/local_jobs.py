"""A tiny single-process job for library tests: a state, one training step, two generations."""

from __future__ import annotations

import os

import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState


def make_state(contract: dict | None = None) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return TrainState(model, optimizer, contract=contract or {"config": "v1"})


def step(state: TrainState) -> None:
    state.model(torch.randn(2, 8)).sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def two_generations(root: str, **config) -> TrainState:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, **config), state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
    return state


def load_with_plain_dcp(dcp_dir: str, fresh: TrainState) -> None:
    """Load a generation's ``dcp/`` files into ``fresh`` with torch's own ``dcp.load`` (no
    dist_ckpt reader): the files must stay readable without this package."""
    import pytest
    import torch.distributed.checkpoint as dcp

    template = fresh.tensor_state()
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(template, checkpoint_id=dcp_dir)
    fresh.load_tensor_state(template)


def assert_same_model(loaded: TrainState, saved: TrainState) -> None:
    for name, value in saved.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value), name


def damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        if how == "truncate":
            handle.truncate(size // 2)
        else:
            handle.seek(size // 2)
            byte = handle.read(1)
            handle.seek(size // 2)
            handle.write(bytes([byte[0] ^ 0x01]))
