"""cProfile helpers: a call on this thread, or the library's background save threads.

:class:`ThreadProfiler` patches nothing: it installs a ``threading.setprofile`` hook, so every
thread started while it is active runs the hook once; a thread whose name starts with the
prefix (the manager names its save threads ``dist-ckpt-save-<generation>``) turns on a cProfile
of its own, the others drop the hook. On Python >= 3.12 cProfile is built on ``sys.monitoring``
and sees every thread of the process, so there the profile is that of the whole process
while the save runs (one profiler at a time; a second save thread is then not profiled).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

SAVE_THREAD_PREFIX = "dist-ckpt-save"


def profile_text(profiler: cProfile.Profile, top: int = 40, sort: str = "cumulative") -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


def profile_call(fn: Callable[[], Any], sort: str = "cumulative") -> tuple[Any, str]:
    """``fn()`` under cProfile on this thread: its result and the top entries."""
    profiler = cProfile.Profile()
    result = profiler.runcall(fn)
    return result, profile_text(profiler, sort=sort)


class ThreadProfiler:
    """Profiles the threads named ``prefix...`` that start inside the ``with`` block.

    Leaving the block joins those threads (up to ``join_timeout_s`` each) so that their
    profiles are complete; :meth:`text` then returns the combined top entries.
    """

    def __init__(self, prefix: str = SAVE_THREAD_PREFIX, join_timeout_s: float = 60.0) -> None:
        self.prefix = prefix
        self.join_timeout_s = join_timeout_s
        self.profilers: list[cProfile.Profile] = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        sys.setprofile(None)  # runs once per new thread
        thread = threading.current_thread()
        if not thread.name.startswith(self.prefix):
            return
        profiler = cProfile.Profile()
        try:
            profiler.enable()  # this thread's profile function from now on
        except ValueError:  # Python >= 3.12: another profiler is active already
            return
        with self._lock:
            self.profilers.append(profiler)
            self.threads.append(thread)

    def __enter__(self) -> ThreadProfiler:
        threading.setprofile(self._hook)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]
        deadline = time.monotonic() + self.join_timeout_s
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def text(self, top: int = 40, sort: str = "cumulative") -> str | None:
        """The combined profile of the threads seen, or None when none started."""
        if not self.profilers:
            return None
        out = io.StringIO()
        stats = pstats.Stats(self.profilers[0], stream=out)
        for profiler in self.profilers[1:]:
            stats.add(profiler)
        stats.strip_dirs().sort_stats(sort).print_stats(top)
        return out.getvalue()
