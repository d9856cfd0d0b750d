"""The race the lazy-snapshot tests need, ordered by fault points rather than by time: a save
whose deferred copy is held (``stage.copy``) until the next optimizer step has arrived in its
pre-hook (``stage.step_waits``), then both released. Shared by ``tests/test_lazy_snapshot.py``
and its CUDA twin ``tests/gpu/test_lazy_cuda.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable

from dist_ckpt import faults


def step_behind_held_copy(update: int, save: Callable[[], object], forward: Callable[[], None],
                          step: Callable[[], None]) -> None:
    """Main thread, one lazy save: ``save()`` with its copy held, ``forward()`` (what runs before
    the step), then ``step()`` in a thread of its own. Returns after the step, having checked
    that the race happened: the step waited in its pre-hook while the copy was pending, and
    the copy ran once. Replaces any fault configuration (``faults.configure``)."""
    copy, arrived = f"copy{update}", f"step{update}"
    faults.configure({"stage.copy": {"block": copy}, "stage.step_waits": {"block": arrived}})
    save()
    faults.wait_reached(copy)  # save() returned; nothing deferred is copied or queued yet
    forward()
    stepper = threading.Thread(target=step, name=f"step-{update}")
    stepper.start()
    faults.wait_reached(arrived)  # the step is in its pre-hook while the copy is pending
    faults.release(copy)
    faults.release(arrived)
    stepper.join(60)
    assert not stepper.is_alive(), f"update {update}: the step is still held after both releases"
    assert faults.hits()["stage.copy"] == 1, f"update {update}: {faults.hits()}"  # this save's copy
