"""Background checkpoint threads yield the CPU to the training loop."""

from __future__ import annotations

import os
import threading


def lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value by ``nice`` (Linux: per thread, inherited by threads it
    starts), so background checkpoint work yields the CPU to the training loop."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    thread_id = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + nice))
    except OSError:
        pass
