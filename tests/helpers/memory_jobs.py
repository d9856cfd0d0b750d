"""Rank bodies for the memory-tier tests (run with ``dist_ckpt.testing.run_ranks``)."""

from __future__ import annotations

import os
import shutil
import socket

import torch.distributed as dist

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


def train_mirrored(rank: int, world: int, root: str, shm_dir: str, run_id: str, mirror: str,
                   steps: int) -> dict:
    """Memory, root and mirror in one job: a save to memory after every update, every 2nd
    persisted, every 2nd persisted one mirrored; ``finish(steps)`` at the end (DONE)."""
    _env(shm_dir, run_id)
    job = build("fsdp", rank, world)
    with manager(job, root, memory_tier=True, persist_every=2, mirror=mirror, mirror_every=2) as mgr:
        for update in range(1, steps):
            train_step(job)
            mgr.save(update)
        train_step(job)
        mgr.finish(steps)
    return {"full": full_state(job)}


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


def node_root(base: str, rank: int) -> str:
    """One rank per node: each node's own disk for the root (nothing of it is shared)."""
    return os.path.join(base, f"disk{rank}", "ckpt")


def hierarchy_train(rank: int, world: int, base: str, shm_dir: str, run_id: str, mirror: str) -> dict:
    """Memory, node-local roots and a mirror: updates 1 to 5 saved to memory, every 2nd
    persisted to each node's root (which keeps 1) and mirrored; the state after update 4 and
    after 5."""
    _env(node_dir(shm_dir, rank), run_id)
    job = build("fsdp", rank, world)
    out: dict = {}
    with manager(job, node_root(base, rank), memory_tier=True, persist_every=2, mirror=mirror,
                 keep_last=1, commit_timeout_s=60) as mgr:
        for update in range(1, 6):
            train_step(job)
            mgr.save(update)
            if update >= 4:
                out[update] = full_state(job)
    return out


def hierarchy_restore(rank: int, world: int, base: str, shm_dir: str, run_id: str, mirror: str) -> list[dict]:
    """Restore (the caller removed what a lost node lost); then every node loses its memory
    and disk, and a second job in the same processes restores again."""
    _env(node_dir(shm_dir, rank), run_id)
    results = []
    for lose_all in (False, True):
        if lose_all:
            dist.barrier()  # both jobs closed: nothing of the first is still running
            shutil.rmtree(node_dir(shm_dir, rank), ignore_errors=True)
            shutil.rmtree(os.path.dirname(node_root(base, rank)), ignore_errors=True)
            dist.barrier()
        job = build("fsdp", rank, world, seed=99)
        with manager(job, node_root(base, rank), memory_tier=True, mirror=mirror, commit_timeout_s=60) as mgr:
            result = mgr.restore()
        results.append({"generation": result.generation, "tier": result.tier, "full": full_state(job),
                        "rejected": [str(p) for p in result.rejected]})
    return results
