"""Run a function on N gloo ranks in spawned processes: multi-rank tests as plain tests.

``run_ranks(world_size, fn, *args)`` spawns ``world_size`` processes, initialises a gloo
process group on loopback in each, calls ``fn(rank, world_size, *args)`` and returns the
per-rank return values (picklable), or raises the first rank's exception.
"""

from __future__ import annotations

import faulthandler
import gc
import hashlib
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable,
           args: tuple, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # an abort in native code (gloo, c10d) then prints every thread's Python stack
    faulthandler.enable(all_threads=True)
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
            pickle.dump(result, handle)
        del result
        # Free the scenario's modules now: FSDP state holds the default group in reference
        # cycles, and a gloo worker thread that drops the last tensor of a finished collective
        # during interpreter finalisation aborts the process (torch PR 179291).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Results are on disk and every group is destroyed; skipping finalisation keeps
    # exit-time races in third-party native threads out of the verdict.
    os._exit(0)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              timeout_s: float = 120.0) -> list[Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world_size, free_port(), out_dir, fn, args, timeout_s),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as handle:
                results.append(pickle.load(handle))
        return results


def tree_digest(root: str) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path: "byte-identical" as data."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return out
