"""Progress marks: each rank's last update and where it is, for the launcher's watchdog.

Under the launcher each rank keeps one small file, ``marks-NNNNN.bin`` in its start's
directory (``DIST_CKPT_LAUNCH_DIR``), mapped into memory: a mark is a few stores into the
mapping. No system call, no fsync, no collective: the launcher reads the bytes from the page
cache of the same host. Outside the launcher :func:`open_writer` returns a writer that does
nothing.

Call order: the rank's main thread only. ``mark(update)`` at every ``save``, ``maybe_save``,
``finish`` and ``heartbeat``; ``section(kind, deadline_s)`` around ``save()``, ``restore()``
and ``finish()``: the time inside is bounded by that deadline (the library's own), so a long
save is never taken for a hang, and a rank still inside a section past its deadline is; leaving
a section is progress (the mark's time moves to that moment, its update stays). The
launcher (another process) calls :func:`read_marks` whenever it likes.

Layout (64 bytes, little-endian): ``seq`` u64 (odd while a write is in progress: a reader
retries), ``update`` i64 (-1 before the first mark), ``mark_s`` f64 (``CLOCK_MONOTONIC``,
the same clock for every process of a host), ``longest_s`` f64 (the longest interval between
two consecutive marks of this start), ``section`` i64 (:data:`SECTIONS`), ``deadline_s`` f64
(when the section must be over; 0 outside one), ``count`` u64 (marks so far), ``pid`` i64.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

MARKS_PREFIX = "marks-"
SECTIONS = ("", "save", "restore", "finish")  # index = the code stored in the file
_LAYOUT = struct.Struct("<QqddqdQq")
SIZE = 64
_RETRIES = 100


def marks_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{MARKS_PREFIX}{rank:05d}.bin")


@dataclass(frozen=True)
class Mark:
    """One rank's latest mark, as the launcher reads it."""

    rank: int
    update: int
    mark_s: float
    longest_s: float
    section: str
    deadline_s: float
    count: int
    pid: int


class MarkWriter:
    """This rank's marks file, mapped; every method is a few stores into the mapping."""

    def __init__(self, path: str | None) -> None:
        self._map: mmap.mmap | None = None
        self._seq = 0
        self.update = -1
        self.mark_s = 0.0
        self.longest_s = 0.0
        self.section_code = 0
        self.deadline_s = 0.0
        self.count = 0
        if path is None:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._write()

    def mark(self, update: int) -> None:
        now = time.monotonic()
        if self.count:
            self.longest_s = max(self.longest_s, now - self.mark_s)
        self.update, self.mark_s = update, now
        self.count += 1
        self._write()

    @contextlib.contextmanager
    def section(self, kind: str, deadline_s: float) -> Iterator[None]:
        """Inside: bounded by ``deadline_s`` seconds from now. Nested sections keep the outer
        one (``finish`` saves; the outer deadline already covers it)."""
        if self.section_code:
            yield
            return
        self.section_code, self.deadline_s = SECTIONS.index(kind), time.monotonic() + deadline_s
        self._write()
        try:
            yield
        finally:
            # leaving a section is progress: the time inside was bounded by its deadline, and
            # the next interval (a hang, a straggler) starts counting from here, not its entry
            self.section_code, self.deadline_s, self.mark_s = 0, 0.0, time.monotonic()
            self._write()

    def _write(self) -> None:
        if self._map is None:
            return
        self._seq += 1  # odd: a reader that sees it retries
        self._map[:8] = self._seq.to_bytes(8, "little")
        _LAYOUT.pack_into(self._map, 0, self._seq, self.update, self.mark_s, self.longest_s,
                          self.section_code, self.deadline_s, self.count, os.getpid())
        self._seq += 1
        self._map[:8] = self._seq.to_bytes(8, "little")

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def open_writer(directory: str | None, rank: int) -> MarkWriter:
    """The rank's writer in the start's directory; one that writes nothing without one (not
    under the launcher) or when the file cannot be made (marks must not fail a job)."""
    if directory is None:
        return MarkWriter(None)
    try:
        os.makedirs(directory, exist_ok=True)
        return MarkWriter(marks_path(directory, rank))
    except OSError:
        return MarkWriter(None)


def read_mark(path: str) -> Mark | None:
    """One rank's mark; None when the file is missing, short, or never stable (a writer
    that died mid-write leaves an odd sequence number: it is not progress)."""
    try:
        with open(path, "rb") as handle:
            for _ in range(_RETRIES):
                handle.seek(0)
                raw = handle.read(SIZE)
                if len(raw) < _LAYOUT.size:
                    return None
                seq, update, mark_s, longest_s, section, deadline_s, count, pid = _LAYOUT.unpack_from(raw)
                if seq % 2 == 0:
                    name = SECTIONS[section] if 0 <= section < len(SECTIONS) else "?"
                    rank = int(os.path.basename(path)[len(MARKS_PREFIX):].split(".")[0])
                    return Mark(rank, update, mark_s, longest_s, name, deadline_s, count, pid)
    except (OSError, ValueError):
        return None
    return None


def read_marks(directory: str) -> dict[int, Mark]:
    """Every rank's mark in a start's directory on this host, by rank."""
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    marks = {}
    for name in sorted(names):
        if name.startswith(MARKS_PREFIX) and name.endswith(".bin"):
            found = read_mark(os.path.join(directory, name))
            if found is not None:
                marks[found.rank] = found
    return marks
