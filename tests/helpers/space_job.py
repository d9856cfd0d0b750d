"""Disk-full scenario, run by tests/test_space.py inside a mount namespace whose checkpoint
root is a small tmpfs. Prints one ``RESULT {json}`` line."""

from __future__ import annotations

import json
import os
import sys

import torch

from dist_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    CommitError,
    InsufficientSpace,
    TrainState,
)
from dist_ckpt.testing import tree_digest


def make_state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 257 KiB of parameters, as much again for momentum
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return TrainState(model, optimizer)


def main(root: str) -> None:
    out: dict = {}
    state = make_state()
    checked = CheckpointConfig(root=root, space_headroom_bytes=0)
    with CheckpointManager(checked, state) as mgr:
        update = 1
        try:
            while update < 50:  # bounded: the tmpfs holds a handful of generations
                mgr.save(update)
                update += 1
        except InsufficientSpace as exc:
            out["refused_at"] = update
            out["refusal"] = str(exc)
    out["committed_before"] = sorted(n for n in os.listdir(root) if n.startswith("gen-"))
    before = tree_digest(root)
    unchecked = CheckpointConfig(root=root, check_free_space=False)
    with CheckpointManager(unchecked, state) as mgr:
        try:
            mgr.save(update)
            out["disk_full_error"] = None
        except CommitError as exc:
            out["disk_full_error"] = str(exc)
    out["unchanged"] = {k: v for k, v in tree_digest(root).items() if k in before} == before
    out["entries_after"] = sorted(os.listdir(root))
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        out["restored"] = mgr.restore().generation
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
