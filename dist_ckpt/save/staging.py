"""Owned staging buffers, allocated once and reused across saves.

``state_dict()`` returns live references; an asynchronous writer must read from a copy the
training loop cannot touch. The pool holds ``slots`` copies (the in-flight bound): each slot
keeps one buffer per tensor, allocated on first use (pinned when the source is on CUDA,
page-aligned when it is a large CPU tensor: see ``_allocate``) and reused while the layout is
unchanged.

``stage`` copies at once (the eager snapshot). ``layout`` builds the staged structure without
the data of the tensors a ``defer`` predicate picks and returns them as (buffer, source) pairs,
which ``dist_ckpt.save.snapshot`` copies later (the lazy snapshot); the others it copies at
once, from CUDA queued on the current stream (the caller synchronises that stream's work).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .. import faults
from ..errors import StagingError
from ..protocol.comm import PendingGather
from ..restart.tree import walk
from ..storage.directio import IN_PLACE_MIN, aligned_empty

Pair = tuple[torch.Tensor, torch.Tensor]  # (staging buffer, live source): a copy still to do


class StagedLayout(NamedTuple):
    staged: Any  # the staged structure: what the DCP plan and the writer see
    deferred: list[Pair]  # copies not done yet
    queued: set[torch.device]  # CUDA devices whose current stream has copies into it queued


class Staged(NamedTuple):
    slot: StagingSlot
    staged: Any  # the slot's copy of the state, as ``StagingSlot.stage`` returned it


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

    def stage(self, state: Any, keep_live: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """Copy ``state`` into this slot's buffers; returns the staged copy of ``state``.
        ``keep_live``: tensors left out (the staged copy holds the live tensor, which nothing
        reads: an incremental save references their bytes, ``dist_ckpt.save.reuse``)."""
        staged, pairs, _ = self.layout(state, lambda _: True, keep_live)
        for buffer, source in pairs:
            buffer.copy_(source, non_blocking=source.is_cuda)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged

    @torch.no_grad()  # DTensor.to_local without an autograd node per tensor
    def layout(self, state: Any, defer: Callable[[torch.Tensor], bool],
               keep_live: Callable[[torch.Tensor], bool] | None = None) -> StagedLayout:
        """The staged layout of ``state`` (buffers allocated or reused, DTensor wrappers, other
        values copied) and the (buffer, source) pairs of the tensors ``defer`` picked, whose
        data is not copied yet. Every other tensor is copied before this returns, except that
        a copy from CUDA is only queued on the current stream of its device (``queued``)."""
        seen: set[str] = set()
        result = StagedLayout(None, [], set())
        staged = self._stage(state, "", seen, result, defer, keep_live or _never)
        for stale in set(self.buffers) - seen:
            self.pool._account(-self._bytes(self.buffers.pop(stale)))
            self._wrappers.pop(stale, None)
        return result._replace(staged=staged)

    def _stage(self, value: Any, path: str, seen: set[str], out: StagedLayout,
               defer: Callable[[torch.Tensor], bool], keep_live: Callable[[torch.Tensor], bool]) -> Any:
        if isinstance(value, torch.Tensor) and keep_live(value):
            return value  # no buffer either: one left from an earlier save is freed
        if isinstance(value, DTensor):
            local = self._buffer(value.to_local(), path, seen, out, defer)
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
            return self._buffer(value, path, seen, out, defer)
        if isinstance(value, dict):
            return {k: self._stage(v, f"{path}/{k}", seen, out, defer, keep_live)
                    for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._stage(v, f"{path}/{i}", seen, out, defer, keep_live)
                     for i, v in enumerate(value)]
            return type(value)(items)
        return copy.deepcopy(value)

    def _buffer(self, source: torch.Tensor, path: str, seen: set[str], out: StagedLayout,
                defer: Callable[[torch.Tensor], bool]) -> torch.Tensor:
        seen.add(path)
        source = source.detach()
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            if buffer is not None:
                self.pool._account(-self._bytes(buffer))
            try:
                buffer = _allocate(source)
            except RuntimeError as exc:
                raise StagingError(f"cannot allocate staging buffer for {path}: {exc}") from exc
            self.buffers[path] = buffer
            self.pool._account(self._bytes(buffer))
        if defer(source):
            out.deferred.append((buffer, source))
        else:
            buffer.copy_(source, non_blocking=source.is_cuda)
            if source.is_cuda:
                out.queued.add(source.device)
        return buffer

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()


def _allocate(source: torch.Tensor) -> torch.Tensor:
    """A staging buffer for ``source``: pinned for a CUDA source (page-aligned already); for a
    CPU source of at least ``IN_PLACE_MIN`` bytes, page-aligned memory of exactly its size,
    which a direct shard write sends to the disk from where it lies (no copy into the write
    buffer). One mapping per such buffer: if the process runs out of mappings, the buffer
    is an ordinary one (its bytes then take the copy)."""
    if not source.is_cuda and source.numel() * source.element_size() >= IN_PLACE_MIN:
        try:
            return aligned_empty(source.shape, source.dtype)
        except OSError:  # ENOMEM: vm.max_map_count reached
            pass
    return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda)


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


def _never(_: torch.Tensor) -> bool:
    return False


def stage_ahead(pool: StagingPool | None, live: Any, pending: PendingGather, rank: int,
                keep_live: Callable[[torch.Tensor], bool] | None = None) -> Staged | None:
    """The eager copy into a free staging slot while the save agreement ``pending`` is in
    flight (the wait for the slowest peer overlaps it); None without staging. The caller
    (inside ``save()``, so the state cannot change meanwhile) drops it if the save does not
    start. On a failure the collective is ended before raising: the peers are in it."""
    if pool is None:
        return None
    slot = None
    try:
        faults.hit("stage.before", rank)
        slot = pool.acquire()
        return Staged(slot, slot.stage(live, keep_live))
    except BaseException:
        if slot is not None:
            pool.release(slot)
        pending.wait()
        raise
