"""The floors the library is measured against: raw sequential write + fsync and raw read of
the same bytes, and the files of a committed generation (read through its tier's store)."""

from __future__ import annotations

import os
import time

import torch

READ_CHUNK = 8 << 20


def byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]


def raw_write(path: str, views: list[memoryview], nbytes: int) -> float:
    """Sequential write of ``nbytes`` from ``views`` (cycled) into a new file, then fsync."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            for view in views:
                chunk = view[:left]
                while len(chunk):
                    written = os.write(fd, chunk)
                    chunk, left = chunk[written:], left - written
                if not left:
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def _read_range(path: str, start: int, left: int, buffer: memoryview) -> None:
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        while left:
            got = handle.readinto(buffer[: min(left, READ_CHUNK)])
            if not got:
                raise OSError(f"{path} is shorter than its manifest says")
            left -= got


def raw_read(files: list[tuple[str, int]], rank: int, world: int) -> float:
    """Sequential read of this rank's 1/world of the concatenated bytes of ``files``."""
    total = sum(size for _, size in files)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buffer = memoryview(bytearray(READ_CHUNK))
    started = time.perf_counter()
    offset = 0
    for path, size in files:
        start, end = max(lo, offset), min(hi, offset + size)
        if start < end:
            _read_range(path, start - offset, end - start, buffer)
        offset += size
    return time.perf_counter() - started


def generation_files(root: str) -> tuple[str, list[tuple[str, int]], int]:
    """The newest committed generation under ``root``: name, (path, size) of every listed file
    and the manifest's total bytes. The generation is validated (sizes) on the way."""
    from dist_ckpt.format.validate import list_generations, validate
    from dist_ckpt.tiers import open_tier

    tier = open_tier(root)
    name = list_generations(tier.store)[0]
    manifest = validate(tier.store, name, digests=False)
    files = [(os.path.join(root, name, manifest.location(f.path)), f.size) for f in manifest.files]
    return name, files, manifest.total_bytes


def evict(directory: str) -> None:
    """Drop every file below ``directory`` from the page cache (``POSIX_FADV_DONTNEED``; the
    files are written and fsynced, so nothing dirty is left to keep): the next read is cold,
    as a restarted job's or a cold node's is."""
    for parent, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
