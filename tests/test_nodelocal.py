"""The whole hierarchy on two nodes: each node's memory, each node's own local disk as the
root (node-local: nothing of it is shared) and one S3 mirror (moto). One gloo rank per node,
each with its own shared-memory base and root directory, as on separate machines.

The job commits every update to memory, persists every 2nd to the roots (each node publishes
its own copy) and mirrors what was persisted. A job that lost both nodes' memory and disks
resumes from the mirror bitwise; one that lost one node resumes from memory (the ring's
replica rebuilds the lost node's part).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dist_ckpt.digests import digest_bytes
from dist_ckpt.format.inventory import inventory
from dist_ckpt.format.manifest import COMMON_FILES, MANIFEST_NAME, Manifest
from dist_ckpt.storage.objectstore import ObjectStore
from dist_ckpt.testing import run_ranks
from tests.helpers import memory_jobs
from tests.helpers.memory_jobs import node_dir, node_root

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
RUN = "h0001"
PERSISTED, NEWEST = "gen-000000000004", "gen-000000000005"


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_node_local_roots_and_mirror(tmp_path, s3_root: str) -> None:
    base, shm_dir = str(tmp_path), str(tmp_path / "shm")
    trained = run_ranks(2, memory_jobs.hierarchy_train, base, shm_dir, RUN, s3_root, timeout_s=180)[0]
    # persisted: each node's root holds its own copy of 4, with its rank's shards and the
    # common files (rank 0 wrote them; node 1's memory lacks them: offered through the store)
    # with the manifest's digests; each node prunes its own copy (keep_last=1): rank 0's node
    # once the mirror no longer needs 2, the other node after its copy of 4, unless the
    # mirror was still uploading 2 then
    assert [n for n in os.listdir(node_root(base, 0)) if n.startswith("gen-")] == [PERSISTED]
    assert PERSISTED in os.listdir(node_root(base, 1))
    for rank in (0, 1):
        root = node_root(base, rank)
        manifest = Manifest.from_bytes(open(os.path.join(root, PERSISTED, MANIFEST_NAME), "rb").read(),
                                       generation=PERSISTED)
        held = {f.path: f for f in manifest.files if os.path.exists(os.path.join(root, PERSISTED, f.path))}
        assert {f.rank for f in held.values() if f.path not in COMMON_FILES} == {rank}
        assert COMMON_FILES <= held.keys()
        for path in COMMON_FILES:
            data = open(os.path.join(root, PERSISTED, path), "rb").read()
            assert digest_bytes(data, held[path].algorithm) == held[path].digest, (rank, path)
    # mirrored: a complete copy of each persisted generation, every digest checked
    remote = {g.name: g.state for g in inventory(ObjectStore(s3_root), digests=True)}
    assert remote == {"gen-000000000002": "committed", PERSISTED: "committed"}

    # one node lost (memory and disk): the newest generation, from memory; then both nodes
    # lost: the newest mirrored generation, from the mirror, bitwise
    shutil.rmtree(node_dir(shm_dir, 1))
    shutil.rmtree(os.path.dirname(node_root(base, 1)))
    ranks = run_ranks(2, memory_jobs.hierarchy_restore, base, shm_dir, RUN, s3_root, timeout_s=180)
    one, both = [r[0] for r in ranks], [r[1] for r in ranks]
    assert [(r["generation"], r["tier"]) for r in one] == [(NEWEST, "memory")] * 2
    assert equal(one[0]["full"], trained[5])
    assert [r["generation"] for r in both] == [PERSISTED] * 2, both[0]["rejected"]
    assert [r["tier"] for r in both] == ["object store"] * 2  # the mirror: no root holds anything
    assert equal(both[0]["full"], trained[4])
