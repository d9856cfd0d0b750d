"""Ranks that disagree at restore (issue 38): each case makes one rank of three refuse alone.

Every rank records what ``restore()`` raised and how long after its start, so the test can
check that all ranks raised the same error, promptly, instead of some waiting in a collective
of the load that the refusing rank never entered.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState, faults

REFUSING_RANK = {"contract": 1, "shape": 2, "read": 0}


def _state(hidden: int, contract: dict[str, Any]) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return TrainState(model, optimizer, contract=contract)


def save_then_disagree(rank: int, world: int, root: str, case: str) -> dict[str, Any]:
    """All ranks: save one generation, then restore it with ``case`` making one rank refuse."""
    contract = {"config": {"lora": {"r": 16, "targets": {"q", "k", "v"}}}}
    config = CheckpointConfig(root=root, async_save=False, commit_timeout_s=30)
    with CheckpointManager(config, _state(8, contract)) as mgr:
        mgr.save(1)
    odd = rank == REFUSING_RANK[case]
    if case == "contract" and odd:
        contract = {"config": {"lora": {"r": 8, "targets": {"q", "k", "v"}}}}
    state = _state(16 if case == "shape" and odd else 8, contract)
    if case == "read":
        faults.configure({"restore.read": {"rank": REFUSING_RANK[case], "raise": True}})
    try:
        with CheckpointManager(config, state) as mgr:
            started = time.monotonic()
            try:
                mgr.restore()
            except Exception as exc:  # noqa: BLE001 - the scenario's outcome, compared across ranks
                return {"error": type(exc).__name__, "message": str(exc),
                        "seconds": time.monotonic() - started,
                        "classes": [c.__name__ for c in type(exc).__mro__]}
            return {"error": None, "seconds": time.monotonic() - started}
    finally:
        faults.configure(None)


LORA = {"r": 16, "target_modules": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"}}


def save_with_a_set(rank: int, world: int, root: str) -> str:
    """All ranks: one generation whose contract holds a set (as PEFT's LoraConfig.to_dict())."""
    with CheckpointManager(CheckpointConfig(root=root, async_save=False),
                           _state(8, {"config": {"lora": LORA}})) as mgr:
        mgr.save(1)
    return str(sys.flags.hash_randomization) + ":" + os.environ.get("PYTHONHASHSEED", "")


def restore_with_a_set(rank: int, world: int, root: str) -> str | None:
    """All ranks: restore that generation; the generation restored (None: fresh)."""
    with CheckpointManager(CheckpointConfig(root=root), _state(8, {"config": {"lora": LORA}})) as mgr:
        return mgr.restore().generation
