"""Shard files written past the page cache (``O_DIRECT``), with a buffered fallback.

A buffered write copies every byte into the page cache, and the kernel later writes it back
and reclaims the pages: that kernel work, not the job's own, becomes most of a save's CPU,
taken from training (figures: docs/performance.md). A checkpoint is read again only after a
failure, so keeping it in the page cache buys little.

``O_DIRECT`` needs the memory address, the file offset and the length of every write aligned
to the device's logical block. Bytes that arrive unaligned go through one aligned
buffer per open file (``CHUNK_BYTES``, from a pool reused across saves) that is written whole;
the file's last partial block is written after clearing ``O_DIRECT``. A large write whose
memory and file offset are both aligned (a page-aligned staging buffer's tensor bytes, which
the shard writer places at aligned offsets: ``save.shardio``) goes to the kernel from where
it lies, without that copy; only its last partial block takes the buffer. A filesystem that
refuses ``O_DIRECT`` (at ``open`` or at the first write: ``EINVAL``) gets the same bytes
buffered.

Call order, on the writing thread of one file: ``open_sink`` -> ``write`` ... -> ``finish``
(every byte handed to the kernel) -> ``fileno`` for the caller's fsync -> ``close``;
``durable_file`` runs the steps after the writes.
"""

from __future__ import annotations

import errno
import fcntl
import math
import mmap
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

# where direct_io="auto" writes past the page cache: local block-device filesystems. Elsewhere
# (NFS, FUSE, overlay, tmpfs, ...) O_DIRECT is refused, slower (every write a synchronous
# round trip) or meaningless, so "auto" writes buffered there.
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs", "f2fs"})
MOUNTINFO = "/proc/self/mountinfo"
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS): always buffered
# the kernel writes a space, tab, newline or backslash in a mount point as an octal escape
_MOUNTINFO_ESCAPE = re.compile(rb"\\([0-7]{3})")
ALIGN = 4096  # a multiple of every logical block size Linux reports (512 or 4096)
CHUNK_BYTES = 8 << 20  # one O_DIRECT write; big enough that the device sees large requests
_OBSERVE_PIECE = 1 << 20  # fits a core's L2 with room to spare
_COPY_WITH_NUMPY = 64 << 10  # numpy's copy releases the GIL; a memoryview copy holds it
IN_PLACE_MIN = 1 << 20  # smaller aligned writes still take the buffer (fewer, larger requests)


Observer = Callable[[memoryview], object]


class Sink(Protocol):
    direct: bool  # whether its bytes bypass the page cache (all but a last partial block)

    def write(self, view: memoryview, observe: Observer | None = None) -> None:
        """Write ``view``; ``observe`` (a digest's ``update``) sees every byte once, in order."""

    def finish(self) -> None: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


class _BufferPool:
    """Aligned (mmap, so page-aligned) write buffers, reused by every save of the process:
    at most one per file being written at once."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def acquire(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        # private: a forked child (a DataLoader worker) gets its own copy, never these pages
        return mmap.mmap(-1, CHUNK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def release(self, buffer: mmap.mmap) -> None:
        with self._lock:
            self._free.append(buffer)


_pool = _BufferPool()


class BufferedSink:
    """Plain buffered writes (tmpfs, scratch files read back at once, refused ``O_DIRECT``)."""

    direct = False

    def __init__(self, path: str) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()

    def write(self, view: memoryview, observe: Observer | None = None) -> None:
        self._file.write(view)
        if observe is not None:
            observe(view)

    def finish(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()


class DirectSink:
    """Writes through an aligned buffer with ``O_DIRECT``; see the module docstring."""

    def __init__(self, path: str) -> None:
        if not O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform", path)
        self._path = path
        self._buffer = _pool.acquire()  # first: nothing to undo if it fails
        try:
            # 0o666 and the umask, as open() does on the buffered path
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o666)
        except BaseException:
            _pool.release(self._buffer)
            raise
        self.direct = True
        self._written = 0  # bytes the kernel took, so far
        self._view = memoryview(self._buffer)
        self._array = np.frombuffer(self._buffer, dtype=np.uint8)
        self._filled = 0

    def write(self, view: memoryview, observe: Observer | None = None) -> None:
        taken = self._write_in_place(view, observe)
        while taken < len(view):
            # a piece small enough to stay in the CPU cache between its copy and its observer,
            # which reads the copy: the source is read from memory once, not twice
            count = min(CHUNK_BYTES - self._filled, len(view) - taken, _OBSERVE_PIECE)
            target = slice(self._filled, self._filled + count)
            if count >= _COPY_WITH_NUMPY:
                np.copyto(self._array[target], np.frombuffer(view[taken:taken + count], dtype=np.uint8))
            else:
                self._view[target] = view[taken:taken + count]
            if observe is not None:
                observe(self._view[target])
            self._filled += count
            taken += count
            if self._filled == CHUNK_BYTES:
                self._write_out(self._view[:CHUNK_BYTES])
                self._filled = 0

    def _write_in_place(self, view: memoryview, observe: Observer | None) -> int:
        """Write the whole blocks of ``view`` straight from its memory when its address and
        its file offset are aligned; returns how many bytes were written (0: none)."""
        if (not self.direct or len(view) < IN_PLACE_MIN
                or (self._written + self._filled) % ALIGN or address(view) % ALIGN):
            return 0
        if self._filled:  # whole blocks: the file offset after them is aligned
            self._write_out(self._view[:self._filled])
            self._filled = 0
        blocks = len(view) - len(view) % ALIGN
        self._write_out(view[:blocks])
        if observe is not None:
            observe(view[:blocks])
        return blocks

    def finish(self) -> None:
        aligned = self._filled - self._filled % ALIGN
        if aligned:
            self._write_out(self._view[:aligned])
        if self._filled > aligned:
            if self.direct:  # the last partial block cannot go out with O_DIRECT
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~O_DIRECT)
            self._write_out(self._view[aligned:self._filled])
        self._filled = 0

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1  # never closed twice: the number may be another file's by then
        try:
            os.close(fd)
        finally:
            self._view.release()
            del self._array
            _pool.release(self._buffer)

    def _write_out(self, view: memoryview) -> None:
        reopened = False
        while len(view):
            try:
                written = os.write(self._fd, view)
            except OSError as exc:
                # EINVAL: the filesystem took the flag at open but refuses the I/O (a FUSE
                # passthrough hands it to a file below), or a short write (a disk filling up)
                # left an unaligned offset: the rest goes through a descriptor opened without
                # the flag, where a real error (ENOSPC) then shows as itself
                if exc.errno != errno.EINVAL or reopened:
                    raise
                self._reopen_buffered()
                reopened = True
                continue
            view = view[written:]
            self._written += written

    def _reopen_buffered(self) -> None:
        fd = os.open(self._path, os.O_WRONLY)
        try:
            os.lseek(fd, self._written, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        os.close(self._fd)
        self._fd = fd
        if self._written == 0:
            self.direct = False


def filesystem_type(path: str, mountinfo: str = MOUNTINFO) -> str | None:
    """The type of the filesystem holding ``path`` (``ext4``, ``nfs4``, ``tmpfs``, ...), from
    the mount table; None where there is none to read (not Linux). ``path`` need not exist
    yet: its nearest existing ancestor decides."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        with open(mountinfo, "rb") as handle:  # bytes: mount points need not be UTF-8
            lines = [os.fsdecode(line) for line in handle.read().splitlines()]
    except OSError:
        return None
    return mount_type(os.path.realpath(existing), lines)


def mount_type(path: str, mountinfo_lines: list[str]) -> str | None:
    """The filesystem type of the mount holding the absolute, resolved ``path``, given the
    lines of ``/proc/self/mountinfo``: the longest mount point above it, and of equal ones the
    last (a later mount on the same point shadows an earlier one)."""
    best: tuple[int, str] | None = None
    for line in mountinfo_lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mount_point = os.fsdecode(_MOUNTINFO_ESCAPE.sub(
            lambda escape: bytes([int(escape.group(1), 8)]), os.fsencode(parts[4])))
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= best[0]):
            best = (len(mount_point), rest.split()[0])
    return best[1] if best is not None else None


def resolve_direct_io(setting: bool | str, path: str) -> bool:
    """``CheckpointConfig.direct_io`` for files below ``path``: True and False as given,
    ``"auto"`` True on a local block-device filesystem (``DIRECT_IO_FILESYSTEMS``)."""
    if setting == "auto":
        return filesystem_type(path) in DIRECT_IO_FILESYSTEMS
    return bool(setting)


def aligned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose bytes start on a page and whose storage is exactly its
    bytes (DCP clones a tensor whose storage is larger), so that a direct sink can write them
    without copying (the shard writer puts them at aligned file offsets). Private anonymous
    memory: a forked child gets its own copy, never these pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor holds the only reference: the mapping is unmapped when the last tensor over it
    # is freed. ``region`` must never escape: its close() would unmap memory a tensor still uses
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def address(view: memoryview) -> int:
    """The memory address of a contiguous buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def open_sink(path: str, *, direct: bool) -> Sink:
    """A sink for a new file at ``path``: ``O_DIRECT`` when ``direct`` and the filesystem takes
    it, buffered otherwise."""
    if direct:
        try:
            return DirectSink(path)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return BufferedSink(path)


@contextmanager
def durable_file(path: str, *, direct: bool) -> Iterator[Sink]:
    """A sink for a new file at ``path`` (``open_sink``): when the block ends without an error,
    every byte is handed to the kernel and fsynced; the sink is closed either way."""
    sink = open_sink(path, direct=direct)
    try:
        yield sink
        sink.finish()
        os.fsync(sink.fileno())
    finally:
        sink.close()
