"""The memory tier on two nodes (one gloo rank each, each with its own shared-memory base, as
on separate machines): restore from memory completes each node's copy from its peer, a node
that lost its memory is rebuilt from the replica its ring neighbour holds, and a damaged or
missing replica falls back to the persistent root. The files cross on torch.distributed: no
rank opens a listener of its own."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dist_ckpt.format.manifest import MANIFEST_NAME
from dist_ckpt.testing import run_ranks
from tests.helpers import memory_jobs
from tests.helpers.memory_jobs import node_dir

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
RUN = "n0001"
NEWEST, PERSISTED = "gen-000000000005", "gen-000000000004"


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train(tmp_path, kind: str = "fsdp", replica: bool = True,
          lost_push: int | None = None) -> tuple[str, str, list[dict]]:
    """5 updates, a save to memory after each, every 2nd persisted: the root lacks the newest.
    Items over 1 KiB count as large here, so that each rank has a tensor file and a small one."""
    root, shm_dir = str(tmp_path / "root"), str(tmp_path / "shm")
    ranks = run_ranks(2, memory_jobs.node_train, root, shm_dir, RUN, 5, 2, kind, replica, 1024,
                      lost_push, timeout_s=180)
    return root, shm_dir, ranks


def replica_of(memory_root: str, generation: str) -> str:
    """The directory of ``generation`` among the replicas a node received (published or
    still under its pending name: the manifest arrived last either way)."""
    parent = memory_root.rstrip("/") + ".replica"
    found = [n for n in os.listdir(parent) if generation in n
             and os.path.exists(os.path.join(parent, n, MANIFEST_NAME))]
    assert len(found) == 1, os.listdir(parent)
    return os.path.join(parent, found[0])


@pytest.mark.parametrize("kind, verify", [("fsdp", True), ("ddp", True), ("ddp", False)])
def test_two_nodes_restore_the_newest_generation_from_memory(tmp_path, kind: str, verify: bool) -> None:
    """DDP: DCP wrote each replicated tensor once, into one rank's file, so each node also
    loads from the other's shard (fetched while DCP loads, with digests on or off)."""
    root, shm_dir, trained = train(tmp_path, kind)
    for rank, other in ((0, 1), (1, 0)):  # each node holds its own files and the other's replica
        replica = replica_of(trained[rank]["memory_root"], NEWEST)
        manifest = json.load(open(os.path.join(replica, MANIFEST_NAME)))
        assert {f["rank"] for f in manifest["files"]} == {0, 1}
        held = {f["path"] for f in manifest["files"] if os.path.exists(os.path.join(replica, f["path"]))}
        assert held == {f["path"] for f in manifest["files"] if f["rank"] == other}
    ranks = run_ranks(2, memory_jobs.node_restore, root, shm_dir, RUN, kind, verify, timeout_s=180)
    assert [(r["generation"], r["tier"], r["rejected"]) for r in ranks] == [(NEWEST, "memory", [])] * 2
    assert equal(ranks[0]["full"], trained[0]["full"])
    # node 1 lacked the generation's common files (rank 0 wrote them): fetched from node 0
    assert ranks[1]["fetched"] >= 2
    if kind == "ddp":  # and node 0 read the parameters DCP wrote into rank 1's shard
        assert ranks[0]["fetched"] >= 1
    else:  # FSDP: only replicated step counts live in the other rank's files: its small file
        shards = sorted(f["path"] for f in manifest["files"] if f["path"].endswith(".distcp"))
        assert shards == [f"dcp/__{r}_{i}.distcp" for r in (0, 1) for i in (0, 1)]  # tensors, small
        fetched = [path for r in ranks for path in r["load_files"]]
        assert fetched and all(path.endswith("_1.distcp") for path in fetched), fetched
    # replicas pushed while training, files exchanged at restore: no TCP listener of dist_ckpt's
    assert [r["listeners"] for r in trained + ranks] == [[]] * 4


def test_a_node_that_lost_its_memory_is_rebuilt_from_its_replica(tmp_path) -> None:
    root, shm_dir, trained = train(tmp_path)
    shutil.rmtree(node_dir(shm_dir, 1))  # node 1 replaced: its memory is gone
    ranks = run_ranks(2, memory_jobs.node_restore, root, shm_dir, RUN, timeout_s=180)
    assert [(r["generation"], r["tier"]) for r in ranks] == [(NEWEST, "memory")] * 2
    assert equal(ranks[0]["full"], trained[0]["full"])
    assert ranks[1]["fetched"] >= 4  # its shard and rank state, the common files, the manifest's peers


def test_a_node_lost_before_its_newest_replica_arrived_is_rebuilt_one_generation_back(tmp_path) -> None:
    """Node 0 never got its generation 5 to node 1 (it died while sending), then lost its
    memory. Node 1 kept its own generation 4 for that case (not every node had announced
    generation 5 replicated), so both nodes resume generation 4 from memory: the replica of
    node 0's files and node 1's own copy. Without that, node 1 would hold generation 5 alone
    and only the persistent root could serve."""
    root, shm_dir, trained = train(tmp_path, lost_push=5)
    held = sorted(n for n in os.listdir(trained[1]["memory_root"]) if n.startswith("gen-"))
    assert held == [PERSISTED, NEWEST], held
    replicas = os.listdir(trained[1]["memory_root"].rstrip("/") + ".replica")
    assert replicas == [PERSISTED], replicas  # node 0's generation 5 never arrived
    shutil.rmtree(node_dir(shm_dir, 0))  # node 0 replaced: its memory and its replicas gone
    ranks = run_ranks(2, memory_jobs.node_restore, root, shm_dir, RUN, timeout_s=180)
    assert [(r["generation"], r["tier"]) for r in ranks] == [(PERSISTED, "memory")] * 2, ranks[0]["rejected"]
    assert ranks[0]["fetched"] >= 4  # its shards, rank state and the common files from node 1
    shutil.rmtree(shm_dir)  # the same generation from the persistent root: the same tensors
    from_root = run_ranks(2, memory_jobs.node_restore, root, shm_dir, RUN, timeout_s=180)
    assert [(r["generation"], r["tier"]) for r in from_root] == [(PERSISTED, "local")] * 2
    assert equal(ranks[0]["full"], from_root[0]["full"])


def test_a_damaged_replica_is_rejected_and_the_root_used(tmp_path) -> None:
    root, shm_dir, trained = train(tmp_path)
    shutil.rmtree(node_dir(shm_dir, 1))
    shard = os.path.join(replica_of(trained[0]["memory_root"], NEWEST), "dcp", "__1_0.distcp")
    with open(shard, "r+b") as handle:  # one bit flipped in node 0's copy of node 1's shard
        handle.seek(os.path.getsize(shard) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    ranks = run_ranks(2, memory_jobs.node_restore, root, shm_dir, RUN, timeout_s=180)
    assert [(r["generation"], r["tier"]) for r in ranks] == [(PERSISTED, "local")] * 2
    # refused before it reached node 1's copy: the damaged bytes were never installed
    assert any("__1_0.distcp" in why and "fails its digest" in why for why in ranks[0]["repair_failures"])
    assert any(NEWEST in why for why in ranks[0]["rejected"]), ranks[0]


def test_without_replicas_a_lost_node_restores_from_the_root(tmp_path) -> None:
    root, shm_dir, trained = train(tmp_path, replica=False)
    assert not os.listdir(trained[0]["memory_root"].rstrip("/") + ".replica")
    shutil.rmtree(node_dir(shm_dir, 1))
    ranks = run_ranks(2, memory_jobs.node_restore, root, shm_dir, RUN, timeout_s=180)
    assert [(r["generation"], r["tier"]) for r in ranks] == [(PERSISTED, "local")] * 2
    assert any(NEWEST in why for why in ranks[0]["rejected"]), ranks[0]
