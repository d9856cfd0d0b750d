"""The memory tier on two nodes: resume from memory, from a neighbour's replica, and from disk.

    python scripts/bench_memory_nodes.py --mib 64 --steps 4
    python scripts/bench_memory_nodes.py --mib 256 --cases replica   # the peer channel's throughput

Two gloo ranks, one per "node" (each with its own shared-memory base directory, so each is its
own filesystem group with its own leader, as on two machines; the peer channel runs over
loopback). The job saves to memory after every update (replicas on) and persists the last
generation to the disk root. Then, per case, a fresh job restores the final generation and the
time of ``restore()`` is reported (median of ``--repeats``, cases alternated):

- memory: both nodes kept their memory (node 1 fetches the common files from node 0);
- replica: node 1 lost its memory and is rebuilt from node 0's replica (every file of node 1
  crosses the peer channel and is hashed before it is installed);
- disk: the memory tier off; the root's files are dropped from the page cache first.

It also reports the peer channel's throughput: replica, a leader's files of one generation
sent to its ring successor during training (the time of ``NodeRing.push_newest`` on the
sender, which returns once the successor holds them; median over the pushes of both nodes);
fetch, the bytes that arrive in node 1's memory during ``before_restore`` in the replica case
(node 1 rebuilt from node 0's replica) over its time (median of ``--repeats``).
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
from dist_ckpt.format.manifest import MANIFEST_NAME, Manifest  # noqa: E402
from dist_ckpt.memory import paths as shm  # noqa: E402
from dist_ckpt.memory.ring import NodeRing  # noqa: E402
from dist_ckpt.testing import run_ranks  # noqa: E402

RUN = "bench-nodes"


def node_base(shm_dir: str, rank: int) -> str:
    return os.path.join(shm_dir, f"node{rank}")


def bytes_below(*directories: str) -> int:
    return sum(os.path.getsize(os.path.join(parent, name)) for directory in directories
               for parent, _, names in os.walk(directory) for name in names)


def time_pushes(pushes: list[tuple[int, float]]) -> None:
    """Record (bytes, seconds) of each push that sent a generation."""
    original = NodeRing.push_newest

    def timed(ring: NodeRing) -> None:
        before, began = ring._pushed, time.perf_counter()
        original(ring)
        elapsed = time.perf_counter() - began
        if ring._pushed is not None and ring._pushed != before:
            directory = os.path.join(ring.tier.root, ring._pushed)
            with open(os.path.join(directory, MANIFEST_NAME), "rb") as handle:
                manifest = Manifest.from_bytes(handle.read(), generation=ring._pushed)
            members = ring._members(ring.comm.rank)
            pushes.append((sum(f.size for f in manifest.files if f.rank in members), elapsed))

    NodeRing.push_newest = timed  # type: ignore[method-assign]


def train(rank: int, world: int, root: str, shm_dir: str, mib: int, steps: int) -> dict:
    os.environ[shm.SHM_DIR_ENV] = node_base(shm_dir, rank)
    os.environ[runinfo.RUN_ID_ENV] = RUN
    pushes: list[tuple[int, float]] = []
    time_pushes(pushes)
    state, model, optimizer = build(mib)
    config = CheckpointConfig(root=root, async_save=True, memory_tier=True, persist_every=steps,
                              keep_last=2, check_free_space=False)
    with CheckpointManager(config, state) as mgr:
        for update in range(1, steps + 1):
            step(model, optimizer)
            mgr.save(update)
        began = time.perf_counter()
    return {"close_s": time.perf_counter() - began, "pushes": pushes}


def resume(rank: int, world: int, root: str, shm_dir: str, mib: int, memory: bool) -> dict:
    os.environ[shm.SHM_DIR_ENV] = node_base(shm_dir, rank)
    os.environ[runinfo.RUN_ID_ENV] = RUN
    state, _, _ = build(mib)
    config = CheckpointConfig(root=root, memory_tier=memory, check_free_space=False)
    with CheckpointManager(config, state) as mgr:
        repair: list[tuple[int, float]] = []
        if mgr.memory is not None:
            runner = mgr.memory
            original = runner.before_restore
            held = (runner.tier.root, runner.tier.root.rstrip("/") + ".fetched")

            def timed() -> None:
                before, began = bytes_below(*held), time.perf_counter()
                original()
                repair.append((bytes_below(*held) - before, time.perf_counter() - began))

            runner.before_restore = timed  # type: ignore[method-assign]
        began = time.perf_counter()
        result = mgr.restore()
        elapsed = time.perf_counter() - began
        fetched = mgr.memory.ring.fetched if mgr.memory is not None and mgr.memory.ring else 0
    return {"restore_s": elapsed, "tier": result.tier, "generation": result.generation,
            "fetched": fetched, "repair": repair}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="state per rank in MiB")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disk-dir", default=os.getcwd())
    parser.add_argument("--cases", default="memory,replica,disk", help="restore cases, comma-separated")
    args = parser.parse_args()
    cases = tuple(c for c in ("memory", "replica", "disk") if c in args.cases.split(","))
    times: dict[str, list[float]] = {case: [] for case in cases}
    fetch_mib_s: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk, \
            tempfile.TemporaryDirectory(prefix="bench-nodes-", dir=shm.DEFAULT_BASE) as shm_dir:
        root = os.path.join(disk, "root")
        trained = run_ranks(2, train, root, shm_dir, args.mib, args.steps, timeout_s=600)
        pushes = [nbytes / seconds / (1 << 20) for r in trained for nbytes, seconds in r["pushes"]]
        saved = os.path.join(disk, "saved-shm")
        shutil.copytree(shm_dir, saved, symlinks=True)  # every case starts from the same memory
        for index in range(args.repeats):
            for case in cases if index % 2 == 0 else cases[::-1]:
                shutil.rmtree(shm_dir)
                shutil.copytree(saved, shm_dir, symlinks=True)
                if case == "replica":
                    shutil.rmtree(node_base(shm_dir, 1))  # node 1 replaced
                evict(root)
                ranks = run_ranks(2, resume, root, shm_dir, args.mib, case != "disk", timeout_s=600)
                expected = "local" if case == "disk" else "memory"
                assert {r["tier"] for r in ranks} == {expected}, (case, ranks)
                times[case].append(max(r["restore_s"] for r in ranks))
                if case == "replica":
                    nbytes, seconds = ranks[1]["repair"][0]
                    fetch_mib_s.append(nbytes / seconds / (1 << 20))
                if index == 0:
                    print(f"{case}: {ranks[0]['generation']} from the {expected} tier, files fetched "
                          f"from the peer: node 0 {ranks[0]['fetched']}, node 1 {ranks[1]['fetched']}")
    print(f"state per rank {args.mib} MiB, 2 nodes of 1 rank, restore() medians of {args.repeats}:")
    disk_s = statistics.median(times["disk"]) if "disk" in times else None
    for case, series in times.items():
        median = statistics.median(series)
        print(f"| {case} | {median:.3f} s | " + (f"{median / disk_s:.2f}x disk |" if disk_s else ""))
    if pushes:
        print(f"peer channel: replica {statistics.median(pushes):.0f} MiB/s "
              f"(median of {len(pushes)} pushes)")
    if fetch_mib_s:
        print(f"peer channel: fetch {statistics.median(fetch_mib_s):.0f} MiB/s "
              f"(node 1 rebuilt from node 0's replica, median of {len(fetch_mib_s)})")


if __name__ == "__main__":
    main()
