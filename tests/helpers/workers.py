"""Training-job building blocks run inside spawned ranks (see dist_ckpt.testing)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from dist_ckpt import CheckpointConfig, CheckpointManager, ResumableSampler, TrainState

NUM_SAMPLES = 96
BATCH = 4
IN, HIDDEN, OUT = 16, 32, 4


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.drop = torch.nn.Dropout(0.2)
        self.mid = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.drop(torch.relu(self.inp(x))))))


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(NUM_SAMPLES, IN, generator=gen), torch.randn(NUM_SAMPLES, OUT, generator=gen)


@dataclass
class Job:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: ResumableSampler
    noise: np.random.Generator
    state: TrainState
    data: tuple[torch.Tensor, torch.Tensor] = field(default_factory=dataset)
    losses: list[float] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)


def build(kind: str, rank: int, world: int, *, seed: int = 0) -> Job:
    """Fresh, seeded objects; kind is plain, ddp or fsdp."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)
    model: torch.nn.Module = Net()
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.inp, model.mid, model.out):
            fully_shard(layer)
        fully_shard(model)
    torch.manual_seed(seed + 1000 + rank)  # per-rank dropout streams
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    sampler = ResumableSampler(NUM_SAMPLES, BATCH, rank=rank, world_size=world, seed=7)
    noise = np.random.default_rng(100 + rank)
    state = TrainState(model, optimizer, scheduler=scheduler, sampler=sampler,
                       numpy_generators={"noise": noise},
                       contract={"config": {"lr": 1e-2, "batch": BATCH}, "data": "synthetic-v1"})
    return Job(model, optimizer, scheduler, sampler, noise, state)


def train_step(job: Job) -> None:
    xs, ys = job.data
    index = job.sampler.next_batch()
    x = xs[index] + torch.from_numpy(job.noise.normal(0.0, 0.1, (len(index), IN))).float()
    x = x * (1.0 + 0.01 * random.random()) + 0.001 * float(np.random.rand())
    loss = torch.nn.functional.mse_loss(job.model(x), ys[index])
    loss.backward()
    job.optimizer.step()
    job.scheduler.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.losses.append(loss.item())
    job.batches.append(index)


def full_state(job: Job) -> dict[str, torch.Tensor] | None:
    """Gathered model + optimizer tensors on rank 0 (None elsewhere), flattened."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    flat: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            flat[path] = value.detach().clone()
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}")

    walk({"model": model_sd, "optim": optim_sd}, "")
    return flat


def manager(job: Job, root: str, **config: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(root=root, **config), job.state)


# ---- scenario bodies (rank, world, *args) ------------------------------------------------
def straight_and_half(rank: int, world: int, kind: str, steps: int, roots: dict[str, bool]) -> dict:
    """N updates straight; then, per root, N/2 updates and a save (sync or async)."""
    job = build(kind, rank, world)
    for _ in range(steps):
        train_step(job)
    out = {"losses": job.losses, "batches": job.batches, "final": full_state(job)}
    for root, async_save in roots.items():
        job = build(kind, rank, world)
        mgr = manager(job, root, async_save=async_save)
        assert mgr.restore().fresh
        for _ in range(steps // 2):
            train_step(job)
        mgr.save(steps // 2, tokens_seen=steps // 2 * BATCH * world)
        if async_save:  # the committed generation must not see updates made after save()
            train_step(job)
        mgr.close()
    return out


def resume_and_finish(rank: int, world: int, kind: str, steps: int, root: str,
                      components: list[str] | None) -> dict:
    job = build(kind, rank, world)
    mgr = manager(job, root)
    result = mgr.restore(components=components)
    for _ in range(result.next_update, steps):
        train_step(job)
    mgr.close()
    return {"generation": result.generation, "next_update": result.next_update,
            "losses": job.losses, "batches": job.batches, "final": full_state(job)}


def save_for_reshard(rank: int, world: int, kind: str, root: str, steps: int) -> dict:
    job = build(kind, rank, world)
    mgr = manager(job, root)
    for _ in range(steps):
        train_step(job)
    mgr.save(steps)
    mgr.close()
    return {"full": full_state(job), "batches": job.batches}


def load_resharded(rank: int, world: int, kind: str, root: str) -> dict:
    job = build(kind, rank, world, seed=99)
    mgr = manager(job, root)
    result = mgr.restore()
    full = full_state(job)
    remaining: list[int] = []
    for index in job.sampler:
        remaining.extend(index)
    mgr.close()
    return {"generation": result.generation, "next_update": result.next_update, "full": full,
            "remaining": remaining, "tokens_seen": result.tokens_seen}


def check_restart(saved: dict, loaded: list[dict], old_world: int, steps: int) -> None:
    """A resharded restart loaded the saved tensors bitwise and hands out every sample once."""
    full = loaded[0]["full"]
    assert saved["full"].keys() == full.keys()
    for key, tensor in saved["full"].items():
        assert torch.equal(tensor, full[key]), f"{key} differs after resharding"
    for rank_result in loaded:
        assert rank_result["generation"] == f"gen-{steps:012d}"
        assert rank_result["next_update"] == steps
    consumed = [i for batch in saved["batches"] for i in batch]
    remaining = [i for r in loaded for i in r["remaining"]]
    assert len(remaining) == len(set(remaining)), "a sample was handed out twice"
    assert len(consumed) * old_world + len(remaining) == NUM_SAMPLES
    assert not set(remaining) & set(consumed)


def environment_and_cwd(rank: int, world: int, name: str) -> tuple[str | None, str, int]:
    """What a started rank sees of its caller: one environment variable, the working
    directory, and its own pid."""
    return os.environ.get(name), os.getcwd(), os.getpid()
