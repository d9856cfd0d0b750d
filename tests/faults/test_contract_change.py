"""A restart whose model changed: refused before anything is mutated, naming the keys."""

from __future__ import annotations

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, ContractMismatch, LayoutMismatch, TrainState
from tests.helpers.matrix import record


class Small(torch.nn.Module):
    def __init__(self, hidden: int = 8, dtype: torch.dtype = torch.float32, extra: bool = False,
                 name: str = "body", head: bool = True) -> None:
        super().__init__()
        self.add_module(name, torch.nn.Linear(4, hidden, dtype=dtype))
        if head:
            self.head = torch.nn.Linear(hidden, 2, dtype=dtype)
        if extra:
            self.extra = torch.nn.Linear(2, 2, dtype=dtype)


def state_of(model: torch.nn.Module, contract: dict | None = None) -> TrainState:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    sum(p.sum() for p in model.parameters()).backward()  # optimizer state exists, as in a job
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return TrainState(model, optimizer, contract=contract or {"config": "v1"})


CHANGES = {
    "renamed": (lambda: Small(name="trunk"), ["model.trunk.weight"], ["model.body.weight"], []),
    "added": (lambda: Small(extra=True), ["model.extra.weight"], [], []),
    "removed": (lambda: Small(head=False), [], ["model.head.weight"], []),
    "shape": (lambda: Small(hidden=16), [], [], ["model.body.weight"]),
    "dtype": (lambda: Small(dtype=torch.float64), [], [], ["model.body.weight"]),
}


def saved_root(tmp_path) -> str:
    root = str(tmp_path)
    with CheckpointManager(CheckpointConfig(root=root, async_save=False), state_of(Small())) as mgr:
        mgr.save(1)
    return root


@pytest.mark.parametrize("change", list(CHANGES))
def test_changed_model_is_refused_before_anything_loads(tmp_path, change: str) -> None:
    root = saved_root(tmp_path)
    build, missing, unexpected, mismatched = CHANGES[change]
    state = state_of(build())
    before = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        with pytest.raises(LayoutMismatch) as caught:
            mgr.restore()
    error = caught.value
    assert all(key in error.missing for key in missing)
    assert all(key in error.unexpected for key in unexpected)
    assert all(key in error.mismatched for key in mismatched)
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())  # untouched
    record("changed model contract", observed=f"{change}: LayoutMismatch ({error}); nothing loaded")


def test_changed_config_digest_is_refused(tmp_path) -> None:
    root = saved_root(tmp_path)
    state = state_of(Small(), contract={"config": "v2"})
    before = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        with pytest.raises(ContractMismatch) as caught:
            mgr.restore()
    assert "config" in caught.value.fields
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    record("changed model contract", observed=f"config digest: {caught.value}")
