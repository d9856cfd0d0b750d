"""Run a function on N gloo ranks in fresh processes: multi-rank tests as plain tests.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` processes, initialises a gloo
process group on loopback in each, calls ``fn(rank, world_size, *args)`` and returns the
per-rank return values (picklable), or raises the first rank's exception.

Ranks are forked from a fork server that imported torch and ``dist_ckpt`` once
(``rank_context``): a rank then starts without paying the interpreter's and torch's import
again, which is most of what a short multi-rank test costs. Each rank is still a process of
its own with no state of the caller's but the environment and working directory it is given
(``rank_environment``, applied first thing by ``enter_rank``). ``DIST_CKPT_RANK_START=spawn``
starts each rank as a fresh interpreter instead.
"""

from __future__ import annotations

import faulthandler
import gc
import hashlib
import os
import pickle
import random
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

START_ENV = "DIST_CKPT_RANK_START"
# imported once by the fork server, so that a rank forked from it starts with them loaded
# (torch._dynamo: what the first optimizer a process constructs imports)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "numpy", "dist_ckpt"]


def rank_context() -> Any:
    """The multiprocessing context that starts ranks: a fork server with ``PRELOAD`` imported
    (one per calling process, started at its first use), or ``spawn`` where the environment
    asks for it or the platform has no fork server."""
    method = os.environ.get(START_ENV, "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    return context


def rank_environment() -> tuple[dict[str, str], str]:
    """What a rank inherits from its caller: the environment and working directory now (a
    fork server's own were fixed when it started)."""
    return dict(os.environ), os.getcwd()


def enter_rank(inherited: tuple[dict[str, str], str]) -> None:
    """First thing in a started rank: the caller's environment and working directory."""
    environment, cwd = inherited
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)


_PORT_DRAW = random.SystemRandom()  # never the seeded global stream of a test


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port that was free just now, for a listener started soon after.

    Drawn at random below the kernel's ephemeral range where there is room: the ports the
    kernel hands to outgoing connections and to ``bind(0)`` of every other process then never
    take it in between, and two suites side by side rarely draw the same one (``bind`` is the
    check that the draw is free)."""
    low, high = 15000, _ephemeral_low()
    for _ in range(64 if high - low >= 1000 else 0):
        port = _PORT_DRAW.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# torch's rendezvous: with this set to "True", every rank, rank 0 included, connects to the
# store at the rendezvous address as a client instead of rank 0 listening there itself
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


@contextmanager
def held_store(timeout_s: float) -> Iterator[int]:
    """The caller's own rendezvous store, listening on a port the kernel chose; yields it.

    Call order: the parent enters this before starting the ranks and leaves it after joining
    them; each rank calls :func:`join_store` before ``init_process_group``
    (``tcp://127.0.0.1:<port>`` or ``env://`` with ``MASTER_PORT``). A port drawn by
    :func:`free_port` is closed until rank 0 binds it, and under a busy suite another test's
    listener sometimes takes it in that gap (rank 0 then fails with EADDRINUSE); a store that is
    already listening before any rank starts leaves no such gap."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    try:
        yield store.port
    finally:
        del store  # the last reference: the server stops listening


def join_store() -> None:
    """In a started rank, before ``init_process_group``: rendezvous as a client of the caller's
    :func:`held_store` at the rendezvous address instead of listening there."""
    os.environ[AGENT_STORE_ENV] = str(True)


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable,
           args: tuple, timeout_s: float, inherited: tuple[dict[str, str], str]) -> None:
    enter_rank(inherited)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # an abort in native code (gloo, c10d) then prints every thread's Python stack
    faulthandler.enable(all_threads=True)
    import torch

    torch.set_num_threads(1)
    join_store()
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
    with tempfile.TemporaryDirectory() as out_dir, held_store(timeout_s) as port:
        context = rank_context()
        mp.start_processes(_entry, args=(world_size, port, out_dir, fn, args, timeout_s,
                                         rank_environment()),
                           nprocs=world_size, join=True, start_method=context.get_start_method())
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
