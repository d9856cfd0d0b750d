"""What one rank of the main run works with: the job, its local tensors, profiling, cleanup."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

from . import jobs
from .profiling import profile_call


class Ctx:
    """One rank of the main 2-rank run (built inside the rank's process)."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any], base: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank, self.world, self.cfg, self.base = rank, world, cfg, base
        self.repeats: int = cfg["repeats"]
        self.model, self.optimizer, self.state = jobs.build_job(cfg["state_mib"], rank, world)
        self.tensors = jobs.local_tensors(self.state.tensor_state())
        self.buffers = [torch.empty_like(t) for t in self.tensors]
        jobs.copy_floor(self.tensors, self.buffers)  # first touch of the buffers is not the floor
        self.state_bytes = jobs.tensor_bytes(self.tensors)
        self.profiles: dict[str, str] = {}

    @property
    def profiling(self) -> bool:
        """True on rank 0 when --profile was given."""
        return bool(self.cfg["profile"]) and self.rank == 0

    def step(self) -> None:
        jobs.train_step(self.model, self.optimizer)

    def profiled(self, name: str, fn: Callable[[], Any], sort: str = "cumulative") -> Any:
        """Run ``fn`` (all ranks); under cProfile on rank 0 when --profile was given."""
        if not self.profiling:
            return fn()
        result, self.profiles[name] = profile_call(fn, sort=sort)
        return result

    def drop(self, *paths: str) -> None:
        """All ranks: after a barrier rank 0 deletes ``paths`` (bounded disk use)."""
        jobs.barrier()
        if self.rank == 0:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        jobs.barrier()
