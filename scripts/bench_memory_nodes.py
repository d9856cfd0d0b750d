"""The memory tier on two nodes: resume from memory, from a neighbour's replica, and from disk.

    python scripts/bench_memory_nodes.py --mib 64 --steps 4

Two gloo ranks, one per "node" (each with its own shared-memory base directory, so each is its
own filesystem group with its own leader, as on two machines; the peer channel runs over
loopback). The job saves to memory after every update (replicas on) and persists the last
generation to the disk root. Then, per case, a fresh job restores the final generation and the
time of ``restore()`` is reported (median of ``--repeats``, cases alternated):

- memory: both nodes kept their memory (node 1 fetches the common files from node 0);
- replica: node 1 lost its memory and is rebuilt from node 0's replica (every file of node 1
  crosses the peer channel and is hashed before it is installed);
- disk: the memory tier off; the root's files are dropped from the page cache first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_memory_tier import build, evict, step  # noqa: E402

from dist_ckpt import CheckpointConfig, CheckpointManager, runinfo  # noqa: E402
from dist_ckpt.memory import paths as shm  # noqa: E402
from dist_ckpt.testing import run_ranks  # noqa: E402

RUN = "bench-nodes"


def node_base(shm_dir: str, rank: int) -> str:
    return os.path.join(shm_dir, f"node{rank}")


def train(rank: int, world: int, root: str, shm_dir: str, mib: int, steps: int) -> dict:
    os.environ[shm.SHM_DIR_ENV] = node_base(shm_dir, rank)
    os.environ[runinfo.RUN_ID_ENV] = RUN
    state, model, optimizer = build(mib)
    config = CheckpointConfig(root=root, async_save=True, memory_tier=True, persist_every=steps,
                              keep_last=2, check_free_space=False)
    with CheckpointManager(config, state) as mgr:
        for update in range(1, steps + 1):
            step(model, optimizer)
            mgr.save(update)
        began = time.perf_counter()
    return {"close_s": time.perf_counter() - began}


def resume(rank: int, world: int, root: str, shm_dir: str, mib: int, memory: bool) -> dict:
    os.environ[shm.SHM_DIR_ENV] = node_base(shm_dir, rank)
    os.environ[runinfo.RUN_ID_ENV] = RUN
    state, _, _ = build(mib)
    config = CheckpointConfig(root=root, memory_tier=memory, check_free_space=False)
    with CheckpointManager(config, state) as mgr:
        began = time.perf_counter()
        result = mgr.restore()
        elapsed = time.perf_counter() - began
        fetched = mgr.memory.ring.fetched if mgr.memory is not None and mgr.memory.ring else 0
    return {"restore_s": elapsed, "tier": result.tier, "generation": result.generation,
            "fetched": fetched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="state per rank in MiB")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disk-dir", default=os.getcwd())
    args = parser.parse_args()
    times: dict[str, list[float]] = {"memory": [], "replica": [], "disk": []}
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk, \
            tempfile.TemporaryDirectory(prefix="bench-nodes-", dir=shm.DEFAULT_BASE) as shm_dir:
        root = os.path.join(disk, "root")
        run_ranks(2, train, root, shm_dir, args.mib, args.steps, timeout_s=600)
        saved = os.path.join(disk, "saved-shm")
        shutil.copytree(shm_dir, saved, symlinks=True)  # every case starts from the same memory
        for index in range(args.repeats):
            order = ("memory", "replica", "disk")
            for case in order if index % 2 == 0 else order[::-1]:
                shutil.rmtree(shm_dir)
                shutil.copytree(saved, shm_dir, symlinks=True)
                if case == "replica":
                    shutil.rmtree(node_base(shm_dir, 1))  # node 1 replaced
                evict(root)
                ranks = run_ranks(2, resume, root, shm_dir, args.mib, case != "disk", timeout_s=600)
                expected = "local" if case == "disk" else "memory"
                assert {r["tier"] for r in ranks} == {expected}, (case, ranks)
                times[case].append(max(r["restore_s"] for r in ranks))
                if index == 0:
                    print(f"{case}: {ranks[0]['generation']} from the {expected} tier, files fetched "
                          f"from the peer: node 0 {ranks[0]['fetched']}, node 1 {ranks[1]['fetched']}")
    print(f"state per rank {args.mib} MiB, 2 nodes of 1 rank, restore() medians of {args.repeats}:")
    disk_s = statistics.median(times["disk"])
    for case, series in times.items():
        median = statistics.median(series)
        print(f"| {case} | {median:.3f} s | {median / disk_s:.2f}x disk |")


if __name__ == "__main__":
    main()
