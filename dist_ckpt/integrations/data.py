"""A ``DataLoader`` whose position is the samples the training loop received.

``ResumableSampler`` (dist_ckpt.restart.sampler) is a global cursor into a seeded per-epoch
permutation: a restore at any world size continues with every sample of the epoch consumed
exactly once. A ``DataLoader`` asks its batch sampler ahead of the loop (its workers prefetch
``prefetch_factor`` batches each), so the sampler's own cursor runs ahead of training. This
module keeps the two apart:

- :class:`ResumableBatchSampler` (the loader's ``batch_sampler``) records, for every batch it
  hands out, the sampler position just after that batch, in order;
- :class:`ResumableLoader` yields the loader's batches and, for each one the loop receives,
  takes the next recorded position as the one to save. Its ``state_dict`` is the position of
  the last batch received, whatever the workers fetched beyond it.

Give the ``ResumableLoader`` to ``TrainState(sampler=...)``: it saves and restores like the
sampler itself. Call order: build both on every rank after ``init_process_group``; iterate in
lockstep (every rank one batch per step); a restore (``load_state_dict``) happens before the
next ``iter()``, which starts from the restored position.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..restart.sampler import ResumableSampler


class ResumableBatchSampler(Sampler[list[int]]):
    """This rank's indices of each global batch, to the end of the current epoch."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler
        # the position after each batch handed out and not yet received by the loop
        self.handed: deque[tuple[int, int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        # a new pass drops what an abandoned pass fetched ahead: the loop never received it
        self.handed.clear()
        for batch in self.sampler:
            self.handed.append((self.sampler.epoch, self.sampler.cursor))
            yield batch

    def __len__(self) -> int:
        """Batches of a whole epoch (the trainers size their schedules with it)."""
        per_step = self.sampler.world_size * self.sampler.batch_size
        return -(-self.sampler.num_samples // per_step)


class ResumableLoader:
    """A ``DataLoader`` over ``dataset`` driven by a ``ResumableSampler``; iterable, sized and
    stateful (``state_dict``/``load_state_dict`` in the sampler's format)."""

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0,
                 **loader_kwargs: Any) -> None:
        self.sampler = ResumableSampler(len(dataset), batch_size, rank=rank, world_size=world_size,
                                        seed=seed, shuffle=shuffle)  # type: ignore[arg-type]
        self.batch_sampler = ResumableBatchSampler(self.sampler)
        self.loader = DataLoader(dataset, batch_sampler=self.batch_sampler, collate_fn=collate_fn,
                                 num_workers=num_workers, **loader_kwargs)
        self.dataset = dataset
        self.batch_size = batch_size
        self._received = self._position()

    def _position(self) -> tuple[int, int]:
        return self.sampler.epoch, self.sampler.cursor

    def __iter__(self) -> Iterator[Any]:
        self._restart_from(self._received)
        for batch in self.loader:
            self._received = self.batch_sampler.handed.popleft()
            yield batch

    def _restart_from(self, position: tuple[int, int]) -> None:
        # the sampler may have run ahead of the loop (prefetch): rewind it to what was received
        self.sampler.epoch, self.sampler.cursor = position

    def __len__(self) -> int:
        return len(self.batch_sampler)

    @property
    def epoch(self) -> int:
        """The epoch of the last batch received (the next ``iter()`` starts the next epoch when
        this one is used up)."""
        return self._received[0]

    @property
    def consumed(self) -> int:
        """Samples every rank together received so far, across epochs (reshard-safe)."""
        epoch, cursor = self._received
        return epoch * self.sampler.num_samples + cursor

    def state_dict(self) -> dict[str, Any]:
        saved = self.sampler.state_dict()
        saved["epoch"], saved["cursor"] = self._received
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._received = self._position()


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator for a loader's workers' base seed, so a resumed run's worker seeds are
    the uninterrupted run's (pass as ``generator=`` to ``ResumableLoader``)."""
    return torch.Generator().manual_seed(seed)
