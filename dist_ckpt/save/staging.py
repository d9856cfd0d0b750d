"""Owned staging buffers, allocated once and reused across saves.

``state_dict()`` returns live references; an asynchronous writer must read from a copy the
training loop cannot touch. The pool holds ``slots`` copies (the in-flight bound): each slot
keeps one buffer per tensor, allocated on first use (pinned when the source is on CUDA) and
reused while the layout is unchanged.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import StagingError
from ..restart.tree import walk


def local_tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of a (nested) state, DTensors as their local shards: what staging copies."""
    return [value.to_local() if isinstance(value, DTensor) else value
            for _, value in walk(state) if isinstance(value, torch.Tensor)]


class StagingSlot:
    def __init__(self, pool: StagingPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.buffers: dict[str, torch.Tensor] = {}
        self._wrappers: dict[str, tuple[tuple, DTensor]] = {}
        self.in_use = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, state: Any) -> Any:
        """Copy ``state`` into this slot's buffers; returns the staged mirror of ``state``."""
        seen: set[str] = set()
        staged = self._stage(state, "", seen)
        for stale in set(self.buffers) - seen:
            self.pool._account(-self._bytes(self.buffers.pop(stale)))
            self._wrappers.pop(stale, None)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged

    def _stage(self, value: Any, path: str, seen: set[str]) -> Any:
        if isinstance(value, DTensor):
            local = self._copy(value.to_local(), path, seen)
            # the wrapper only describes the buffer; reuse it while buffer and spec are the same
            key = (id(local), value.device_mesh, tuple(value.placements), value.shape, value.stride())
            cached = self._wrappers.get(path)
            if cached is None or cached[0] != key:
                wrapper = DTensor.from_local(local, value.device_mesh, value.placements,
                                             run_check=False, shape=value.shape, stride=value.stride())
                cached = (key, wrapper)
                self._wrappers[path] = cached
            return cached[1]
        if isinstance(value, torch.Tensor):
            return self._copy(value, path, seen)
        if isinstance(value, dict):
            return {k: self._stage(v, f"{path}/{k}", seen) for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._stage(v, f"{path}/{i}", seen) for i, v in enumerate(value)]
            return type(value)(items)
        return copy.deepcopy(value)

    def _copy(self, source: torch.Tensor, path: str, seen: set[str]) -> torch.Tensor:
        seen.add(path)
        source = source.detach()
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if buffer is not None:
                self.pool._account(-self._bytes(buffer))
            try:
                buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu",
                                     pin_memory=source.is_cuda)
            except RuntimeError as exc:
                raise StagingError(f"cannot allocate staging buffer for {path}: {exc}") from exc
            self.buffers[path] = buffer
            self.pool._account(self._bytes(buffer))
        buffer.copy_(source, non_blocking=source.is_cuda)
        return buffer

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()


class StagingPool:
    """``slots`` reusable staging copies. ``acquire``/``release`` are called by the owning
    rank's manager (main thread acquires, the background writer releases)."""

    def __init__(self, slots: int) -> None:
        self._slots = [StagingSlot(self, i) for i in range(slots)]
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0

    def _account(self, delta: int) -> None:
        with self._lock:
            self.allocated_bytes += delta
            if delta > 0:
                self.allocations += 1
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)

    def acquire(self) -> StagingSlot:
        with self._lock:
            for slot in self._slots:
                if not slot.in_use:
                    slot.in_use = True
                    return slot
        raise StagingError("no free staging slot: more saves in flight than the bound")

    def release(self, slot: StagingSlot) -> None:
        with self._lock:
            slot.in_use = False

    def free(self) -> None:
        for slot in self._slots:
            self._account(-slot.nbytes)
            slot.buffers.clear()
            slot._wrappers.clear()
