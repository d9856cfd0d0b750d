"""Lazy snapshot (``CheckpointConfig(snapshot="lazy")``): ``save()`` returns before the copy of
the parameters and the optimizer state; the next optimizer step waits for it.

Contract: parameters and optimizer state change in place only in ``optimizer.step()``, so a
step pre-hook on every optimizer of the ``TrainState`` waits for the pending copies; any other
in-place change of them before that step must call ``CheckpointManager.wait_staged()`` first.
Every other tensor (model buffers such as BatchNorm statistics, which the forward pass
updates) is copied before ``save()`` returns, as the eager snapshot copies everything.

Order for one save on one rank:

1. main thread, in ``save()``: ``begin`` builds the staging slot's layout of the state
   (buffers allocated on the first save of a layout, DTensor wrappers, non-tensor values
   copied, the tensors not deferred copied, from CUDA queued on the current stream); the
   manager prepares the DCP plan over it (structure only, no data) and serialises the small
   state. On CUDA an event is recorded on the current stream of each source device: the
   deferred copy must see the work queued before ``save()`` (the last step).
2. save thread, first (``run_after_copy``), at the training priority since a step may be
   waiting: fault point ``stage.copy``; CPU tensors copied; CUDA tensors copied on a side
   stream after that event, then a done event recorded (``enqueued``); every event
   synchronised (``finished``). Then, at the background priority, ``run_save`` writes.
3. the step pre-hook waits for ``enqueued`` and makes the step's stream wait for the done
   events (the CPU does not stall on the device copy); ``wait_staged()`` waits for
   ``finished``.

A copy that fails, or is not done by the commit deadline (the waiters then go on, so a hung
copy never hangs training, and the generation could not commit anyway), fails the save
through the ordinary path: the rank's write raises the copy's error, its report carries it,
and every rank raises ``CommitError``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import faults, logs, runinfo
from ..config import CheckpointConfig
from ..errors import ConfigError, StagingError
from ..protocol.comm import Comm
from ..restart.state import TrainState
from .coordinator import run_save_in_background
from .request import SaveJob
from .staging import Pair, StagedLayout, StagingSlot

log = logs.get(__name__)


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


@torch.no_grad()  # DTensor.to_local without an autograd node per tensor
def changed_only_by_step(model: torch.nn.Module,
                         optimizers: Iterable[torch.optim.Optimizer]) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor of the state shares storage with a parameter or an optimizer state
    tensor: the tensors only ``optimizer.step()`` changes, which the lazy copy may defer."""
    storages = {_storage(p) for p in model.parameters()}
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            storages.update(_storage(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    storages.discard(0)  # empty tensors: nothing to defer
    return lambda tensor: _storage(tensor) in storages


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class PendingCopy:
    """The deferred tensor copy of one lazy snapshot, run once by its save thread."""

    def __init__(self, layout: StagedLayout, *, generation: str, rank: int, deadline: float,
                 side_stream: Callable[[torch.device], torch.cuda.Stream]) -> None:
        self.generation = generation
        self.rank = rank
        self.deadline = deadline  # monotonic; the save's commit deadline
        self.enqueued = threading.Event()  # CPU tensors copied, device copies queued
        self.finished = threading.Event()  # every copy done (or failed)
        self.error: BaseException | None = None
        self._cpu = [(b, s) for b, s in layout.deferred if not s.is_cuda]
        self._cuda: dict[torch.device, list[Pair]] = {}
        for buffer, source in layout.deferred:
            if source.is_cuda:
                self._cuda.setdefault(source.device, []).append((buffer, source))
        self._side_stream = side_stream
        # after the layout's queued copies too: synchronising it means those are done
        self._ready = {d: _record(torch.cuda.current_stream(d)) for d in {*self._cuda, *layout.queued}}
        self._done: list[tuple[torch.device, torch.cuda.Event]] = []
        self._abandoned = False
        self._lock = threading.Lock()

    def run(self) -> None:
        """Copy (the save thread); never raises: a failure is left in ``error``."""
        try:
            faults.hit("stage.copy", self.rank)
            for buffer, source in self._cpu:
                buffer.copy_(source)
            for device, pairs in self._cuda.items():
                stream = self._side_stream(device)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(self._ready[device])
                    for buffer, source in pairs:
                        buffer.copy_(source, non_blocking=True)
                        source.record_stream(stream)  # its memory outlives the queued copy
                    self._done.append((device, _record(stream)))
            self._settle(self.enqueued)
            for event in [*self._ready.values(), *(done for _, done in self._done)]:
                event.synchronize()
        except BaseException as exc:  # noqa: BLE001 - the save fails with it (module docstring)
            with self._lock:
                self.error = self.error or exc
        finally:
            self._settle(self.enqueued)  # waiters never hang on a failed copy
            self._settle(self.finished)

    def _settle(self, event: threading.Event) -> None:
        with self._lock:
            if self._abandoned and self.error is None:
                self.error = StagingError(
                    f"the staging copy of {self.generation} was not done by the commit deadline; "
                    "training went on, so the copy may be torn")
            event.set()

    def wait(self, *, for_step: bool) -> None:
        """Until the copy no longer reads the live tensors, or the deadline (then the save
        is failed instead: ``error``). ``for_step``: the caller's current CUDA streams wait
        for the device copies instead of the CPU."""
        event = self.enqueued if for_step else self.finished
        if for_step and not event.is_set():
            faults.hit("stage.step_waits", self.rank)
        if not event.wait(max(0.0, self.deadline - time.monotonic())):
            with self._lock:
                if not event.is_set():
                    if not self._abandoned:  # once, not at every step until the copy ends
                        log.error("the staging copy of %s is not done at the commit deadline: "
                                  "the save fails, training goes on", self.generation)
                    self._abandoned = True
                    return
        if for_step:
            for device, done in self._done:
                torch.cuda.current_stream(device).wait_event(done)


def run_after_copy(pending: PendingCopy | None, job: SaveJob, comm: Comm, io_threads: int,
                   commit_timeout_s: float, nice: int) -> None:
    """The save thread of an asynchronous save: the lazy copy first, then the write."""
    if pending is not None:
        pending.run()  # before lower_thread_priority: the next optimizer step may wait for it
        if pending.error is not None:  # the writer raises it: this rank's report carries it
            job.request.staging_error = StagingError(
                f"the lazy staging copy failed: {type(pending.error).__name__}: {pending.error}")
    run_save_in_background(job, comm, io_threads, commit_timeout_s, nice)


class LazySnapshots:
    """The pending copies of one manager's lazy saves and the step pre-hooks that wait for
    them (removed by ``close``)."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.optimizers = [state.optimizer] if state.optimizer is not None else []
        self._pending: list[PendingCopy] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._handles = [o.register_step_pre_hook(self._before_step) for o in self.optimizers]

    def begin(self, slot: StagingSlot, live: Any, *, generation: str, rank: int, timeout_s: float,
              keep_live: Callable[[torch.Tensor], bool] | None = None) -> tuple[Any, PendingCopy]:
        """Main thread, in ``save()``: the staged layout of ``live`` and its deferred copy."""
        layout = slot.layout(live, changed_only_by_step(self.state.model, self.optimizers), keep_live)
        return layout.staged, PendingCopy(layout, generation=generation, rank=rank,
                                          deadline=time.monotonic() + timeout_s,
                                          side_stream=self._side_stream)

    def track(self, pending: PendingCopy) -> None:
        """From now on optimizer steps and ``wait`` wait for ``pending`` (its thread starts next)."""
        with self._lock:
            self._pending.append(pending)

    def wait(self, *, for_step: bool = False) -> None:
        with self._lock:
            self._pending = [p for p in self._pending if not p.finished.is_set()]
            pending = list(self._pending)
        for copy in pending:
            copy.wait(for_step=for_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._pending:  # a step costs one attribute read while nothing is pending
            self.wait(for_step=True)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device=device)
            return self._streams[device]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def lazy_snapshots(config: CheckpointConfig, state: TrainState) -> LazySnapshots | None:
    """The manager's lazy snapshots: None unless ``snapshot="lazy"`` with ``async_save`` (a
    synchronous save writes before ``save()`` returns, so there is nothing to defer)."""
    if config.snapshot != "lazy" or not config.async_save:
        return None
    if not isinstance(state.optimizer, torch.optim.Optimizer):
        error = ConfigError("snapshot='lazy' needs the TrainState's torch.optim.Optimizer, whose "
                            "step pre-hook waits for the copy; without one use snapshot='eager' "
                            "(field snapshot)")
        runinfo.report_failure(error)  # a restart cannot cure it
        raise error
    return LazySnapshots(state)
