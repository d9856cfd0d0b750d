"""--profile-cpu: where one save's CPU time goes, on rank 0 (the compare phase).

:class:`CpuProfile` records, over its ``with`` block: the process's user and system CPU seconds
(``getrusage``, every thread), the same split per thread (``/proc/self/task/<tid>/stat``, sampled
every 50 ms so that threads that end inside the block count too; Python threads by name, native
ones such as gloo's and DCP's pool workers by id), and, when ``py-spy`` is installed (next to this
interpreter or on PATH), a ``py-spy record --native`` of the process summarised as the hottest
frames. Not a test; nothing in the library is patched.
"""

from __future__ import annotations

import collections
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from types import TracebackType
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")
ATTACH_TIMEOUT_S = 30.0


def thread_ticks() -> dict[int, tuple[int, int]]:
    """User and system clock ticks of every thread of this process, by thread id."""
    out: dict[int, tuple[int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (int(fields[11]), int(fields[12]))  # utime, stime (fields 14 and 15)
    return out


class ThreadSampler(threading.Thread):
    """Per-thread CPU ticks, sampled until :meth:`stop`; the deltas since the start."""

    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True, name="cpu-profile-sampler")
        self.interval_s = interval_s
        self.start_ticks = thread_ticks()
        self.last: dict[int, tuple[int, int]] = dict(self.start_ticks)
        self.names: dict[int, str] = {}
        self._stop_event = threading.Event()

    def sample(self) -> None:
        self.last.update(thread_ticks())
        for thread in threading.enumerate():
            if thread.native_id is not None:
                self.names[thread.native_id] = thread.name

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.sample()

    def stop(self) -> list[dict[str, Any]]:
        self._stop_event.set()
        self.join()
        self.sample()
        rows = []
        for tid, (user, system) in self.last.items():
            user0, system0 = self.start_ticks.get(tid, (0, 0))
            if tid == self.native_id or (user - user0) + (system - system0) == 0:
                continue
            rows.append({"thread": self.names.get(tid, f"native {tid}"), "tid": tid,
                         "user_s": (user - user0) / TICKS, "sys_s": (system - system0) / TICKS})
        return sorted(rows, key=lambda r: -(r["user_s"] + r["sys_s"]))


def py_spy_path() -> str | None:
    local = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return local if os.access(local, os.X_OK) else shutil.which("py-spy")


class PySpy:
    """``py-spy record --native --format raw`` of this process until :meth:`stop`."""

    def __init__(self, exe: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="bench-py-spy-")
        self.path = os.path.join(self.dir, "stacks.txt")
        with open(os.path.join(self.dir, "stderr.txt"), "w") as err:
            self.proc = subprocess.Popen(
                [exe, "record", "--pid", str(os.getpid()), "--native", "--threads", "--function",
                 "--rate", "200", "--format", "raw", "--output", self.path],
                stdout=subprocess.PIPE, stderr=err, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:  # py-spy prints "Sampling process ..." once attached
            line = self.proc.stdout.readline()
            self.log.append(line)
            if not line or "Sampling process" in line:
                break

    def stop(self) -> dict[str, Any]:
        """Stop recording (SIGINT: py-spy writes its file) and summarise the stacks."""
        self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        try:
            with open(os.path.join(self.dir, "stderr.txt")) as handle:
                self.log += [out or "", handle.read()]
            with open(self.path) as handle:
                stacks = handle.read()
        except OSError:
            return {"error": "".join(self.log).strip()[-2000:]}
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return summarise_stacks(stacks)


# frames of a thread that waits (py-spy's idle detection misses waits inside native code)
WAIT_MARKERS = ("PyThread_acquire_lock_timed", "pthread_cond_wait", "pthread_cond_timedwait",
                "_queue_SimpleQueue_get", "Event.wait (", "Condition.wait (", "epoll_wait", "nanosleep")


def frame_name(frame: str) -> str:
    """A native frame without a symbol (``0x7f... (libcrypto.so.3)``) counts as its library."""
    return frame.split(" ", 1)[1] if frame.startswith("0x") and " " in frame else frame


def summarise_stacks(raw: str, top: int = 25) -> dict[str, Any]:
    """Hottest frames of py-spy's raw (collapsed) stacks, waits left out: self and inclusive
    samples, and samples per thread."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = waiting = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count, frames = int(count_text), [frame_name(f) for f in stack.split(";")]
        total += count
        if any(marker in frame for frame in frames for marker in WAIT_MARKERS):
            waiting += count
            continue
        threads[frames[0]] += count
        own[frames[-1]] += count
        for frame in set(frames[1:]):
            inclusive[frame] += count
    return {"samples": total, "waiting": waiting, "threads": threads.most_common(top),
            "self": own.most_common(top), "inclusive": inclusive.most_common(top)}


class CpuProfile:
    """Process and per-thread CPU split of the ``with`` block, plus py-spy stacks if available."""

    def __init__(self, spy: bool = True) -> None:
        self.result: dict[str, Any] = {}
        self.spy_exe = py_spy_path() if spy else None

    def __enter__(self) -> CpuProfile:
        self.spy = PySpy(self.spy_exe) if self.spy_exe else None
        self.sampler = ThreadSampler()
        self.sampler.start()
        self.usage = resource.getrusage(resource.RUSAGE_SELF)
        self.started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        wall = time.perf_counter() - self.started
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.result = {"wall_s": wall, "user_s": usage.ru_utime - self.usage.ru_utime,
                       "sys_s": usage.ru_stime - self.usage.ru_stime,
                       "threads": self.sampler.stop()}
        self.result["py_spy"] = self.spy.stop() if self.spy is not None else (
            "py-spy not installed (.venv/bin/pip install py-spy)")


def format_profile(result: dict[str, Any]) -> str:
    """The printed form of a :class:`CpuProfile` result."""
    lines = [f"wall {result['wall_s']:.3f} s, process CPU user {result['user_s']:.3f} s + "
             f"system {result['sys_s']:.3f} s"]
    lines += [f"  {r['thread'][:40]:40s} user {r['user_s']:7.3f} s  sys {r['sys_s']:7.3f} s"
              for r in result["threads"][:15]]
    spy = result["py_spy"]
    if not isinstance(spy, dict) or "samples" not in spy:
        return "\n".join(lines + [f"py-spy: {spy if isinstance(spy, str) else spy.get('error')}"])
    lines.append(f"py-spy --native: {spy['samples']} samples of active threads (200 Hz), of which "
                 f"{spy['waiting']} wait on a lock, queue or event (left out below)")
    for title in ("threads", "self", "inclusive"):
        lines.append(f"  {title}:")
        lines += [f"    {count:6d} {frame[:150]}" for frame, count in spy[title]]
    return "\n".join(lines)
