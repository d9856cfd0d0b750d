"""An index-addressed distributed sampler whose position survives a change of world size.

The state is a global cursor into a seeded per-epoch permutation, plus the seed and the
epoch. Each global step hands out the next ``world_size * batch_size`` indices of the
permutation, rank ``r`` taking every ``world_size``-th of them starting at ``r``. A restart
with any world size continues from the same cursor, so every sample of the epoch is consumed
exactly once across the ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ValidationError


class ResumableSampler:
    """Hands each rank its share of the next global batch; call order per step: all ranks
    call :meth:`next_batch` once (or iterate) in lockstep."""

    def __init__(self, num_samples: int, batch_size: int, *, rank: int | None = None,
                 world_size: int | None = None, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError("num_samples and batch_size must be positive")
        if rank is None or world_size is None:
            from ..protocol.comm import current_rank_and_world

            rank, world_size = current_rank_and_world()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _permutation(self) -> torch.Tensor:
        if self._order is None or self._order_epoch != self.epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=gen)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> list[int]:
        """This rank's indices of the next global batch; starts a new epoch when one ends."""
        if self.cursor >= self.num_samples:
            self.epoch += 1
            self.cursor = 0
        global_batch = self._permutation()[self.cursor : self.cursor + self.world_size * self.batch_size]
        self.cursor += len(global_batch)
        return global_batch[self.rank :: self.world_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        """Batches until the end of the current epoch."""
        if self.cursor >= self.num_samples:
            self.epoch += 1
            self.cursor = 0
        while self.cursor < self.num_samples:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "seed": self.seed, "epoch": self.epoch,
                "cursor": self.cursor, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValidationError(
                    f"sampler {key} changed: checkpoint has {state[key]!r}, job has {getattr(self, key)!r}"
                )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
