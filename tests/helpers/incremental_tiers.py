"""Incremental generations across tiers (issue 28): what the mirror and the memory tier's
tests share. Rank bodies run in-process (one rank, no process group) or through
``dist_ckpt.testing.run_ranks``."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from dist_ckpt.format.manifest import OBJECTS_DIR, is_object_path
from tests.helpers.finetune_jobs import Job, manager


def manifest(root: str, generation: str) -> dict:
    with open(os.path.join(root, generation, "manifest.json"), encoding="utf-8") as handle:
        return json.load(handle)


def objects_of(root: str, generation: str) -> dict[str, int]:
    """The shared objects a generation lists: path -> size."""
    return {f["path"]: f["size"] for f in manifest(root, generation)["files"] if is_object_path(f["path"])}


def own_bytes(root: str, generation: str) -> int:
    return sum(f["size"] for f in manifest(root, generation)["files"] if not is_object_path(f["path"]))


def inodes(root: str) -> dict[str, int]:
    """objects/<name> -> inode, for the objects under ``root`` (none without ``objects/``)."""
    folder = os.path.join(root, OBJECTS_DIR)
    if not os.path.isdir(folder):
        return {}
    return {f"{OBJECTS_DIR}/{name}": os.stat(os.path.join(folder, name)).st_ino
            for name in os.listdir(folder) if is_object_path(f"{OBJECTS_DIR}/{name}")}


def flip_byte(path: str) -> bytes:
    """Flip one bit in the middle of ``path`` (same size); returns the damaged bytes."""
    with open(path, "r+b") as handle:
        data = bytearray(handle.read())
        data[len(data) // 2] ^= 0x01
        handle.seek(0)
        handle.write(data)
    return bytes(data)


def assert_same(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == found.keys()
    for key, tensor in expected.items():
        assert torch.equal(tensor, found[key]), key


def restore(rank: int, world: int, kind: str, root: str, **config: Any) -> dict:
    """The newest generation that validates (or repairs), into fresh objects; ``config``: the
    manager's other fields (a mirror, say)."""
    job = Job(kind, rank, world, seed=99)
    mgr = manager(job, root, **config)
    try:
        result = mgr.restore()
    finally:
        mgr.close()
    full = job.full()
    if dist.is_initialized():
        dist.barrier()
    return {"generation": result.generation, "tier": result.tier, "full": full,
            "rejected": [(p.generation, p.path) for p in result.rejected],
            "repaired": [(r.generation, r.path, r.source, r.kept) for r in result.repaired]}



def train(rank: int, world: int, kind: str, root: str, saves: list[int],
          config: dict | None = None) -> dict:
    """Train, saving at each update in ``saves``; rank 0 waits for the replays (persistence,
    mirror) after each save. ``config``: ``CheckpointConfig`` fields, and ``bump_after``: an
    update after whose step a frozen weight changes in place (the save of that update writes
    it as a new object). Returns the full state at each save."""
    options = dict(config or {})
    bump_after = options.pop("bump_after", None)
    job = Job(kind, rank, world)
    out: dict[str, Any] = {"full": {}}
    with manager(job, root, **options) as mgr:
        for update in range(1, max(saves) + 1):
            job.step()
            if update == bump_after:
                with torch.no_grad():
                    job.inner.base1.weight.add_(1.0)
            if update in saves:
                mgr.save(update)
                mgr.wait()
                if rank == 0 and mgr.replayer is not None:
                    assert mgr.replayer.drain(60)
                out["full"][update] = job.full()
    if dist.is_initialized():
        dist.barrier()
    return out


def restore_with(rank: int, world: int, kind: str, root: str, config: dict) -> dict:
    """:func:`restore` with the manager's other fields as one positional dict (what
    ``run_ranks`` passes on)."""
    return restore(rank, world, kind, root, **config)
