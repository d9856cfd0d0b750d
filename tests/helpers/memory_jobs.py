"""Rank bodies for the memory-tier tests (run with ``dist_ckpt.testing.run_ranks``)."""

from __future__ import annotations

import os
import socket

from dist_ckpt import faults, runinfo
from dist_ckpt.memory import paths as shm
from dist_ckpt.save import shardio
from tests.helpers.workers import build, full_state, manager, train_step


def _env(shm_dir: str, run_id: str) -> None:
    os.environ[shm.SHM_DIR_ENV] = shm_dir
    os.environ[runinfo.RUN_ID_ENV] = run_id


def train(rank: int, world: int, root: str, shm_dir: str, run_id: str, steps: int,
          persist_every: int, finish: bool = False) -> dict:
    """Save to memory after every update; optionally ``finish`` (DONE)."""
    _env(shm_dir, run_id)
    job = build("fsdp", rank, world)
    with manager(job, root, memory_tier=True, persist_every=persist_every) as mgr:
        start = mgr.restore().next_update
        for update in range(start, steps):
            train_step(job)
            if update + 1 < steps or not finish:
                mgr.save(update + 1)
        if finish:
            mgr.finish(steps)
        memory_root = mgr.tiers.target.local_root
    return {"full": full_state(job), "memory_root": memory_root}


def restore(rank: int, world: int, root: str, shm_dir: str, run_id: str) -> dict:
    _env(shm_dir, run_id)
    job = build("fsdp", rank, world, seed=99)
    with manager(job, root, memory_tier=True) as mgr:
        result = mgr.restore()
    return {"generation": result.generation, "tier": result.tier, "full": full_state(job),
            "rejected": [str(p) for p in result.rejected],
            "repaired": [(r.path, r.source, r.kept) for r in result.repaired],
            "repair_summary": result.repair_summary}


def record_listeners() -> list[str]:
    """The TCP listeners Python code of this process opens from now on (``socket.listen``
    is where every one starts: ``create_server`` and socketserver call it). torch's store
    and gloo's transport listen in C++: they do not count."""
    opened: list[str] = []
    original = socket.socket.listen

    def listen(sock: socket.socket, *args: int) -> None:
        opened.append(f"{sock.getsockname()}")
        original(sock, *args)

    socket.socket.listen = listen  # type: ignore[method-assign]
    return opened


def node_dir(shm_dir: str, rank: int) -> str:
    """One rank per node: each rank's memory tier lives in its own base directory, as on
    separate machines (two filesystem groups, each its own leader)."""
    return os.path.join(shm_dir, f"node{rank}")


def node_train(rank: int, world: int, root: str, shm_dir: str, run_id: str, steps: int,
               persist_every: int, kind: str = "fsdp", replica: bool = True,
               small_item_bytes: int | None = None, lost_push: int | None = None) -> dict:
    """Save to each node's memory after every update; the replica roots at the end.
    ``small_item_bytes``: the bound of a rank's small-items file (this model's tensors are
    all under the default). ``lost_push``: from that update's save on, rank 0's node sends no
    replica (as if it died while sending): every earlier pass finished before."""
    _env(node_dir(shm_dir, rank), run_id)
    listeners = record_listeners()
    if small_item_bytes is not None:
        shardio.SMALL_ITEM_BYTES = small_item_bytes
    job = build(kind, rank, world)
    with manager(job, root, memory_tier=True, persist_every=persist_every,
                 memory_replica=replica) as mgr:
        for update in range(1, steps + 1):
            train_step(job)
            if update == lost_push:
                mgr.wait()
                mgr.pruner.settle()  # the earlier pushes are done
                faults.configure({"ring.push": {"rank": 0, "raise": True}})
            mgr.save(update)
        memory_root = mgr.tiers.target.local_root
    return {"full": full_state(job), "memory_root": memory_root, "listeners": listeners}


def node_restore(rank: int, world: int, root: str, shm_dir: str, run_id: str,
                 kind: str = "fsdp", verify_digests: bool = True) -> dict:
    _env(node_dir(shm_dir, rank), run_id)
    listeners = record_listeners()
    job = build(kind, rank, world, seed=99)
    with manager(job, root, memory_tier=True) as mgr:
        result = mgr.restore(verify_digests=verify_digests)
        ring = mgr.memory.ring
    return {"generation": result.generation, "tier": result.tier, "full": full_state(job),
            "rejected": [str(p) for p in result.rejected], "fetched": ring.fetched,
            "repair_failures": ring.repair_failures, "load_files": ring.fetched_for_load,
            "listeners": listeners}
