"""The memory tier (``CheckpointConfig(memory_tier=True)``): saves commit to each node's shared
memory, every Nth generation is persisted to the root, and restore prefers memory when it
validates (2 gloo ranks; world-size change and corruption fall back to the root)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dist_ckpt import CheckpointConfig, ConfigError
from dist_ckpt.format.inventory import inventory
from dist_ckpt.format.manifest import MANIFEST_NAME, REJECTED_DIR
from dist_ckpt.format.validate import list_generations, validate
from dist_ckpt.memory import paths as shm
from dist_ckpt.replay.record import read_mirror_state
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.storage.objectstore import ObjectStore
from dist_ckpt.testing import run_ranks
from tests.helpers import memory_jobs
from tests.helpers.matrix import record

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
RUN = "t0001"


def generations(path: str) -> list[str]:
    return sorted(list_generations(LocalStore(path)))


def committed(path: str) -> list[str]:
    return [g for g in generations(path) if os.path.exists(os.path.join(path, g, MANIFEST_NAME))]


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def saved(tmp_path):
    """5 updates, a save to memory after each; every 2nd persisted to the root."""
    root, shm_dir = str(tmp_path / "root"), str(tmp_path / "shm")
    ranks = run_ranks(2, memory_jobs.train, root, shm_dir, RUN, 5, 2, timeout_s=180)
    return root, shm_dir, ranks[0]


def test_memory_holds_newest_root_every_nth_and_restore_uses_memory(saved) -> None:
    root, shm_dir, trained = saved
    memory = trained["memory_root"]
    assert memory == os.path.join(shm.run_dir(RUN, root, shm_dir), shm.root_digest(root))
    assert committed(memory) == ["gen-000000000005"], "memory keeps the newest only"
    assert committed(root) == ["gen-000000000002", "gen-000000000004"]
    # the root never held generation 5: loading it proves the load came from memory
    ranks = run_ranks(2, memory_jobs.restore, root, shm_dir, RUN, timeout_s=180)
    assert {(r["generation"], r["tier"]) for r in ranks} == {("gen-000000000005", "memory")}
    assert equal(ranks[0]["full"], trained["full"])


def test_bit_flip_in_memory_falls_back_to_root(saved) -> None:
    root, shm_dir, trained = saved
    memory = os.path.join(trained["memory_root"], "gen-000000000005")
    flip_largest_shard(memory)  # the root never held it: no good copy anywhere
    ranks = run_ranks(2, memory_jobs.restore, root, shm_dir, RUN, timeout_s=180)
    assert {(r["generation"], r["tier"]) for r in ranks} == {("gen-000000000004", "local")}
    assert any(p.startswith("gen-000000000005") and shm_dir in p for p in ranks[0]["rejected"]), \
        ranks[0]["rejected"]
    assert not os.path.exists(memory), "the damaged in-memory generation is dropped"


def test_bit_flip_in_memory_is_repaired_from_the_root(saved) -> None:
    """The root holds the same save of the newest generation (copied there, as persistence
    would): the damaged in-memory shard is replaced by the root's copy, kept aside under the
    memory tier's ``rejected/``, and the newest generation loads from memory."""
    root, shm_dir, trained = saved
    newest = "gen-000000000005"
    memory = os.path.join(trained["memory_root"], newest)
    shutil.copytree(memory, os.path.join(root, newest))
    shard = flip_largest_shard(memory)
    ranks = run_ranks(2, memory_jobs.restore, root, shm_dir, RUN, timeout_s=180)
    assert {(r["generation"], r["tier"]) for r in ranks} == {(newest, "memory")}
    assert all(r["rejected"] == [] for r in ranks)
    assert ranks[0]["repair_summary"] == f"repaired 1 file(s) of {newest} from root"
    [(path, source, kept)] = ranks[0]["repaired"]
    assert (path, source) == (shard, "root") and kept is not None
    assert kept.startswith(os.path.join(trained["memory_root"], REJECTED_DIR, f"{newest}-files-"))
    assert os.path.isfile(os.path.join(kept, shard))
    validate(LocalStore(trained["memory_root"]), newest)
    assert equal(ranks[0]["full"], trained["full"])
    record("damaged file, good copy elsewhere", observed=f"bitflip in in-memory {shard} of {newest}, "
           f"2 ranks: {ranks[0]['repair_summary']}; restored {newest} from memory")


def flip_largest_shard(generation_dir: str) -> str:
    manifest = json.load(open(os.path.join(generation_dir, MANIFEST_NAME)))
    shard = max((f for f in manifest["files"] if f["path"].endswith(".distcp")), key=lambda f: f["size"])
    with open(os.path.join(generation_dir, shard["path"]), "r+b") as handle:
        handle.seek(shard["size"] // 2)
        byte = handle.read(1)[0]
        handle.seek(shard["size"] // 2)
        handle.write(bytes([byte ^ 0x10]))
    return shard["path"]


def test_other_world_size_skips_memory_with_a_reason(saved) -> None:
    root, shm_dir, _ = saved
    ranks = run_ranks(1, memory_jobs.restore, root, shm_dir, RUN, timeout_s=180)
    assert (ranks[0]["generation"], ranks[0]["tier"]) == ("gen-000000000004", "local")
    assert any("saved by 2 ranks, this job has 1" in p for p in ranks[0]["rejected"]), ranks[0]["rejected"]


def test_finish_persists_the_final_generation_then_done(tmp_path) -> None:
    root, shm_dir = str(tmp_path / "root"), str(tmp_path / "shm")
    run_ranks(2, memory_jobs.train, root, shm_dir, RUN, 3, 100, True, timeout_s=180)
    assert committed(root) == ["gen-000000000003"]  # persist_every=100: only the final one
    done = json.load(open(os.path.join(root, "DONE.json")))
    assert done["generation"] == "gen-000000000003"


def test_memory_root_and_mirror_in_one_job_done_after_the_mirror(tmp_path, s3_root: str) -> None:
    """Updates 1 to 4 saved to memory, every 2nd persisted (2, 4), every 2nd persisted one
    mirrored (4); ``finish(5)`` persists and mirrors 5 whatever the counts say, then DONE."""
    root, shm_dir = str(tmp_path / "root"), str(tmp_path / "shm")
    run_ranks(2, memory_jobs.train_mirrored, root, shm_dir, RUN, s3_root, 5, timeout_s=180)
    assert committed(root) == ["gen-000000000002", "gen-000000000004", "gen-000000000005"]
    remote = [g.name for g in inventory(ObjectStore(s3_root), digests=True) if g.state == "committed"]
    assert sorted(remote) == ["gen-000000000004", "gen-000000000005"]
    mirrored = read_mirror_state(root)
    assert mirrored["last_completed"] == "gen-000000000005"
    done = os.path.join(root, "DONE.json")
    assert json.load(open(done))["generation"] == "gen-000000000005"
    assert os.stat(done).st_mtime >= mirrored["completed_unix"], "DONE before the mirror had it"


def test_config_errors_name_the_field(monkeypatch, tmp_path) -> None:
    assert CheckpointConfig(root=str(tmp_path), memory_tier=True, mirror="s3://bucket/x").mirror_every == 1
    with pytest.raises(ConfigError, match="persist_every"):
        CheckpointConfig(root=str(tmp_path), memory_tier=True, persist_every=0)
    with pytest.raises(ConfigError, match="persist_interval_s"):
        CheckpointConfig(root=str(tmp_path), persist_interval_s=60)
    with pytest.raises(ConfigError, match="persist_interval_s"):
        CheckpointConfig(root=str(tmp_path), memory_tier=True, persist_interval_s=0)
    for field, bad in (("persist_queue", 0), ("persist_queue", 65), ("persist_timeout_s", 0)):
        with pytest.raises(ConfigError, match=field):
            CheckpointConfig(root=str(tmp_path), memory_tier=True, **{field: bad})
    for field, value in (("persist_queue", 4), ("persist_timeout_s", 60)):
        with pytest.raises(ConfigError, match=f"{field}=.*needs memory_tier=True"):
            CheckpointConfig(root=str(tmp_path), **{field: value})
    from dist_ckpt.memory.tier import memory_root
    with pytest.raises(ConfigError, match="memory_tier"):
        memory_root(str(tmp_path), None)
    with pytest.raises(ConfigError, match="memory_tier"):
        memory_root(str(tmp_path), "../escape")


def _persisted(config: CheckpointConfig, times: list[float]) -> list[int]:
    """Which of the generations committed at ``times`` (seconds after the start) persist."""
    from dist_ckpt.memory.runner import PersistPolicy

    now = [0.0]
    policy = PersistPolicy(config, clock=lambda: now[0])
    chosen = []
    for index, at in enumerate(times, start=1):
        now[0] = at
        if policy.due():
            chosen.append(index)
    return chosen


def test_persistence_follows_the_count_the_interval_or_both(tmp_path) -> None:
    times = [1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 25.0]
    base = {"root": str(tmp_path), "memory_tier": True}
    assert _persisted(CheckpointConfig(**base), times) == [1, 2, 3, 4, 5, 6, 7]
    assert _persisted(CheckpointConfig(**base, persist_every=3), times) == [3, 6]
    # the interval alone: a generation once 5 s passed since the last one chosen
    assert _persisted(CheckpointConfig(**base, persist_interval_s=5), times) == [4, 7]
    # both: whichever comes first, the interval counted from the last one chosen
    assert _persisted(CheckpointConfig(**base, persist_every=3, persist_interval_s=8), times) == [3, 5, 6, 7]


def test_persistence_has_its_own_queue_and_deadline(monkeypatch, tmp_path) -> None:
    """The persist channel takes ``persist_queue`` and ``persist_timeout_s``; the mirror's
    settings (``mirror_queue``, ``mirror_timeout_s``) are the mirror's only."""
    from types import SimpleNamespace

    from dist_ckpt.memory import runner

    made: dict = {}
    monkeypatch.setattr(runner, "open_memory_tier", lambda root, run_id: SimpleNamespace())
    monkeypatch.setattr(runner, "NodeRing", lambda *args, **kwargs: None)
    monkeypatch.setattr(runner, "Replayer", lambda *args, **kwargs: made.update(kwargs) or SimpleNamespace())
    config = CheckpointConfig(root=str(tmp_path), memory_tier=True, persist_queue=5, persist_timeout_s=70,
                              mirror_queue=3, mirror_timeout_s=90)
    retention = SimpleNamespace(prune_root=None, prune_memory=None)
    runner.MemoryTierRunner(config, root=None).start_persisting(SimpleNamespace(rank=1), retention)
    assert (made["channel"], made["queue_length"], made["timeout_s"]) == ("persist", 5, 70)
