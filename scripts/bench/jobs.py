"""The benchmark job (an FSDP2 stack of linear layers + AdamW) and small timing helpers.

Shared by the benchmark package (``python -m scripts.bench``) and ``scripts/bench_s3.py``; not
part of the library or the tests. Uses only the public API (``TrainState``, ``ResumableSampler``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

MiB = 1 << 20


class Wide(torch.nn.Module):
    """A stack of square linear layers sized so that model + AdamW state is ``state_mib``
    per rank when sharded over ``world`` ranks with FSDP2."""

    def __init__(self, state_mib: int, world: int, layers: int = 8) -> None:
        super().__init__()
        params_total = state_mib * MiB * world // (3 * 4)  # fp32 params + exp_avg + exp_avg_sq
        width = int((params_total / layers) ** 0.5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Adapted(torch.nn.Module):
    """Fine-tuning: a frozen base of square linear layers (``base_mib`` of fp32 weights per
    rank when sharded over ``world`` ranks; over 1 rank for DDP, which replicates) and, per
    layer, a trainable low-rank adapter (down to ``adapter_rank``, then up: LoRA's shape) whose
    parameters are the only ones the optimizer holds."""

    def __init__(self, base_mib: int, world: int, layers: int = 8, adapter_rank: int = 8) -> None:
        super().__init__()
        width = int((base_mib * MiB * world // 4 / layers) ** 0.5)
        def linears(fan_in: int, fan_out: int) -> torch.nn.ModuleList:
            return torch.nn.ModuleList(torch.nn.Linear(fan_in, fan_out, bias=False) for _ in range(layers))

        self.layers = linears(width, width)
        self.down, self.up = linears(width, adapter_rank), linears(adapter_rank, width)
        for layer in self.layers:
            layer.weight.requires_grad_(False)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, down, up in zip(self.layers, self.down, self.up, strict=True):
            x = torch.relu(layer(x) + up(down(x)))
        return x


JOBS = ("full", "finetune")
Job = tuple[torch.nn.Module, torch.optim.Optimizer, Any]  # model, optimizer, TrainState


def build_job(state_mib: int, rank: int, world: int, kind: str = "fsdp", job: str = "full") -> Job:
    return build_job_sized(state_mib, rank, world, world, kind, job)


def build_job_sized(state_mib: int, rank: int, world: int, size_world: int, kind: str = "fsdp",
                    job: str = "full") -> Job:
    """Like :func:`build_job` on ``world`` ranks, but with the model that ``build_job`` builds for
    ``size_world`` ranks (same global model: for restoring a generation at another world size).
    ``kind``: ``fsdp`` (FSDP2, every layer its own unit) or ``ddp``. ``job``: ``full`` (every
    parameter trained: ``state_mib`` is model + AdamW state) or ``finetune`` (``Adapted``:
    ``state_mib`` is the frozen base)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from dist_ckpt import ResumableSampler, TrainState

    torch.manual_seed(0)
    shards = size_world if kind == "fsdp" else 1
    model: torch.nn.Module = Wide(state_mib, shards) if job == "full" else Adapted(state_mib, shards)
    if kind == "fsdp":
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                fully_shard(module)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    sampler = ResumableSampler(10_000, 2, rank=rank, world_size=world)
    train_step(model, optimizer)
    return model, optimizer, TrainState(model, optimizer, sampler=sampler)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               before_step: Callable[[], None] | None = None) -> None:
    """Forward, backward, ``before_step()`` (what must finish before the parameters and the
    optimizer state change), optimizer step."""
    width = model.width if hasattr(model, "width") else model.module.width
    x = torch.randn(2, int(width))  # type: ignore[arg-type]
    model(x).sum().backward()
    if before_step is not None:
        before_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def local_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state, DTensors as their local shards (what a save stages)."""
    out: list[torch.Tensor] = []

    def walk(value: Any) -> None:
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    walk(state)
    return out


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def run_two_ranks(rank_fn: Callable[..., Any], cfg: dict[str, Any], report: Callable[..., dict[str, Any]],
                  *, environment: Any, prefix: str, timeout_s: float, parent: str | None = None,
                  json_path: str | None = None) -> dict[str, Any]:
    """A diagnostic's run (``restore_ab``, ``lost_ab``): ``rank_fn(rank, world, cfg, base)`` on 2
    ranks of the imported library's ``run_ranks`` in a scratch directory (removed after), under
    ``environment`` (a context manager the ranks start in); ``report(ranks, cfg)``'s summary,
    also written to ``json_path``."""
    import json
    import shutil
    import tempfile

    from dist_ckpt.testing import run_ranks  # the library measured: imported late, on purpose

    base = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        with environment:
            ranks = run_ranks(2, rank_fn, cfg, base, timeout_s=timeout_s)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    summary = report(ranks, cfg)
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(summary, handle, indent=1)
    return summary


def median_quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (one value: itself three times)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine() -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, "
            f"python {platform.python_version()}, torch {torch.__version__}")


def copy_floor(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> float:
    """Time of a plain copy of ``tensors`` into preallocated ``buffers`` (the staging floor)."""
    started = time.perf_counter()
    for source, target in zip(tensors, buffers, strict=True):
        target.copy_(source)
    return time.perf_counter() - started
