"""Fine-tuning jobs for incremental generations: a frozen base (large enough for each of its
weights to be a shared object) with a small trainable adapter, run inside spawned ranks."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from tests.helpers.workers import full_state as _full_state

WIDTH = 192  # one frozen weight: 192*192*4 = 144 KiB, a shared object on 1 or 2 ranks


class Tuned(torch.nn.Module):
    """``base1``/``base2`` frozen; ``adapter`` (low rank) and ``head`` trained."""

    def __init__(self) -> None:
        super().__init__()
        self.base1 = torch.nn.Linear(WIDTH, WIDTH)
        self.base2 = torch.nn.Linear(WIDTH, WIDTH)
        self.adapter = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4, bias=False),
                                           torch.nn.Linear(4, WIDTH, bias=False))
        self.head = torch.nn.Linear(WIDTH, 2)
        for layer in (self.base1, self.base2):
            layer.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.base1(x))
        hidden = self.base2(hidden) + self.adapter(hidden)
        return self.head(torch.relu(hidden))


class Job:
    def __init__(self, kind: str, rank: int, world: int, seed: int = 0) -> None:
        torch.manual_seed(seed)
        model: torch.nn.Module = Tuned()
        self.inner = model
        if kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for layer in (model.base1, model.base2, model.adapter, model.head):
                fully_shard(layer)
            fully_shard(model)
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        self.state = TrainState(model, self.optimizer, contract={"job": "finetune"})
        self.rank = rank
        self.generator = torch.Generator().manual_seed(100 + rank)

    def step(self) -> None:
        x = torch.randn(8, WIDTH, generator=self.generator)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def full(self) -> dict[str, torch.Tensor] | None:
        return _full_state(self)  # type: ignore[arg-type]


def manager(job: Job, root: str, **config: Any) -> CheckpointManager:
    config.setdefault("async_save", False)
    return CheckpointManager(CheckpointConfig(root=root, **config), job.state)


def _inodes(root: str) -> dict[str, int]:
    """Object name -> inode: a rewritten object is renamed in anew (another inode)."""
    folder = os.path.join(root, "objects")
    if not os.path.isdir(folder):
        return {}
    return {name: os.stat(os.path.join(folder, name)).st_ino for name in os.listdir(folder)}


def _change(job: Job, how: str) -> None:
    """A change to a frozen tensor the proof must see."""
    inner = job.inner
    with torch.no_grad():
        if how == "inplace":  # the version counter moves
            inner.base1.weight.add_(1.0)
        elif how == "replace":  # another parameter object, new bytes
            old = inner.base1.weight
            inner.base1.weight = torch.nn.Parameter(old.detach() * 2.0, requires_grad=False)
        elif how == "pointer":  # the same object, its data somewhere else
            inner.base1.weight.data = inner.base1.weight.data * 3.0
        else:
            raise ValueError(how)


def run(rank: int, world: int, kind: str, root: str, saves: list[int],
        options: dict[str, Any] | None = None) -> dict:
    """Train, saving at each update in ``saves``. ``options``: ``CheckpointConfig`` fields,
    and ``change`` (``inplace``, ``replace``, ``pointer``) of a frozen weight after update
    ``change_after`` (``run_ranks`` passes positional arguments only). Returns, per save, the
    full state (rank 0), the staging bytes held and the objects' inodes."""
    config = dict(options or {})
    change, change_after = config.pop("change", None), config.pop("change_after", None)
    job = Job(kind, rank, world)
    mgr = manager(job, root, **config)
    out: dict[str, Any] = {"full": {}}
    for update in range(1, max(saves) + 1):
        job.step()
        if change is not None and update == change_after:
            _change(job, change)
        if update in saves:
            mgr.save(update)
            mgr.wait()
            out["full"][update] = job.full()
            out.setdefault("staged_bytes", {})[update] = \
                mgr.staging.allocated_bytes if mgr.staging is not None else None
            out.setdefault("inodes", {})[update] = _inodes(root)
    mgr.close()
    if dist.is_initialized():
        dist.barrier()
    return out


def restore(rank: int, world: int, kind: str, root: str) -> dict:
    """The newest generation that validates, into fresh objects."""
    job = Job(kind, rank, world, seed=99)
    mgr = manager(job, root)
    result = mgr.restore()
    full = job.full()
    mgr.close()
    return {"generation": result.generation, "full": full}


def resume_and_save(rank: int, world: int, kind: str, root: str, saves: list[int]) -> dict:
    """Restore the newest generation, then train on and save at each update in ``saves``;
    returns the objects' inodes before the first save and after each."""
    job = Job(kind, rank, world, seed=99)
    mgr = manager(job, root)
    result = mgr.restore()
    out: dict[str, Any] = {"generation": result.generation, "inodes": {0: _inodes(root)}, "full": {}}
    for update in range(result.next_update + 1, max(saves) + 1):
        job.step()
        if update in saves:
            mgr.save(update)
            out["inodes"][update] = _inodes(root)
            out["full"][update] = job.full()
    mgr.close()
    if dist.is_initialized():
        dist.barrier()
    return out
