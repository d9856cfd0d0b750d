"""Incremental generations and the memory tier (issue 28, item 4): saves to memory reuse the
objects in memory's own ``objects/``; persistence to the root (a replay) copies each object
once, and again only where the root lacks it or holds it with another size; the launcher's
persist at breakpoint copies only the objects the root lacks and installs them before its
rename; a chained mirror uploads each object once.

One-rank jobs run in this process (no process group); the memory tier lives below the test's
own shared-memory base (``conftest.own_shared_memory``)."""

from __future__ import annotations

import os

import pytest

from dist_ckpt import runinfo
from dist_ckpt.format.manifest import OBJECTS_DIR, PENDING_PREFIX
from dist_ckpt.format.objects import COPIES_DIR, copy_path
from dist_ckpt.format.validate import list_generations, validate
from dist_ckpt.memory.breakpoint import persist_memory
from dist_ckpt.memory.tier import memory_root
from dist_ckpt.replay.record import read_mirror_state
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers import incremental_tiers
from tests.helpers.finetune_jobs import Job, manager
from tests.helpers.incremental_tiers import assert_same, inodes, objects_of, train

RUN = "t0028"
GEN = {n: f"gen-{n:012d}" for n in range(1, 6)}


@pytest.fixture(autouse=True)
def run_id(monkeypatch) -> None:
    monkeypatch.setenv(runinfo.RUN_ID_ENV, RUN)  # the launcher's, which the memory tier needs


def no_pending(root: str) -> bool:
    return not any(name.startswith(PENDING_PREFIX) for name in os.listdir(root))


def test_memory_reuses_its_objects_and_persistence_copies_each_once(tmp_path) -> None:
    root = str(tmp_path / "root")
    memory = memory_root(root, RUN)
    job = Job("plain", 0, 1)
    seen_memory, seen_root = [], []
    with manager(job, root, memory_tier=True, persist_every=1) as mgr:
        assert mgr.tiers.target.local_root == memory
        for update in (1, 2, 3):
            job.step()
            mgr.save(update)
            mgr.wait()
            assert mgr.replayer.drain(60)
            seen_memory.append(inodes(memory))
            seen_root.append(inodes(root))
        frozen = objects_of(root, GEN[1])
        assert len(frozen) == 2
        # memory reuses its own objects: listed by each generation, never written again
        assert seen_memory[0].keys() == set(frozen) and seen_memory.count(seen_memory[0]) == 3
        assert objects_of(memory, GEN[3]) == frozen
        # the root got each object once: the later persistences found them in place
        assert seen_root[0].keys() == set(frozen) and seen_root.count(seen_root[0]) == 3
        for n in (1, 2, 3):
            assert objects_of(root, GEN[n]) == frozen
            validate(LocalStore(root), GEN[n])
        # the root keeps a second copy of each (memory does not last: not one), memory none
        assert all(os.path.isfile(os.path.join(root, copy_path(p))) for p in frozen)
        assert not os.path.exists(os.path.join(memory, COPIES_DIR))
        # an object of another size in the root is copied again by the next persistence
        damaged = sorted(frozen)[0]
        os.truncate(os.path.join(root, damaged), frozen[damaged] // 2)
        job.step()
        mgr.save(4)
        mgr.wait()
        assert mgr.replayer.drain(60)
        saved = job.full()
    assert os.path.getsize(os.path.join(root, damaged)) == frozen[damaged]
    after = inodes(root)
    assert after[damaged] != seen_root[0][damaged]
    assert {k: v for k, v in after.items() if k != damaged} == \
        {k: v for k, v in seen_root[0].items() if k != damaged}
    for n in (1, 2, 3, 4):
        validate(LocalStore(root), GEN[n])
    assert no_pending(root)
    restored = incremental_tiers.restore(0, 1, "plain", root)  # the root alone
    assert (restored["generation"], restored["tier"]) == (GEN[4], "local")
    assert_same(saved, restored["full"])


def test_persist_at_breakpoint_copies_only_the_objects_the_root_lacks(tmp_path) -> None:
    """The root holds gen 2 (persisted); memory holds gen 3, whose base1 weight changed: one
    new object, one shared with gen 2. Persisting at breakpoint copies the new one only."""
    root = str(tmp_path / "root")
    memory = memory_root(root, RUN)
    trained = train(0, 1, "plain", root, [1, 2, 3],
                    {"memory_tier": True, "persist_every": 2, "bump_after": 3})
    assert list_generations(LocalStore(root)) == [GEN[2]]
    assert list_generations(LocalStore(memory)) == [GEN[3]]
    before = inodes(root)
    old, new = objects_of(root, GEN[2]), objects_of(memory, GEN[3])
    assert len(set(new) - set(old)) == 1 and len(set(new) & set(old)) == 1
    done = persist_memory(memory, root)
    assert done is not None and done.generation == GEN[3], done
    after = inodes(root)
    assert after.keys() == set(old) | set(new)
    assert {k: after[k] for k in before} == before, "the objects the root held were not copied again"
    # the root keeps second copies (persisted ones made them): the new object gets one too
    assert all(os.path.isfile(os.path.join(root, copy_path(p))) for p in set(old) | set(new))
    validate(LocalStore(root), GEN[3])
    validate(LocalStore(root), GEN[2])
    assert no_pending(root)
    assert not os.path.exists(os.path.join(root, GEN[3], OBJECTS_DIR, sorted(set(new) - set(old))[0]))
    restored = incremental_tiers.restore(0, 1, "plain", root)
    assert restored["generation"] == GEN[3]
    assert_same(trained["full"][3], restored["full"])


def test_memory_root_and_mirror_each_hold_one_copy_of_each_object(s3_root: str, tmp_path) -> None:
    """Memory -> root -> mirror, chained: every generation reaches the mirror, whose objects
    went up once (each save's upload: its own files only, after the first)."""
    root = str(tmp_path / "root")
    job = Job("plain", 0, 1)
    sent = []
    with manager(job, root, memory_tier=True, persist_every=1, mirror=s3_root, mirror_every=1,
                 keep_last=2, mirror_keep_last=2) as mgr:
        store = mgr.tiers.mirror.store
        for update in (1, 2, 3):
            job.step()
            before = store.bytes_sent
            mgr.save(update)
            mgr.wait()
            assert mgr.replayer.drain(60)
            sent.append(store.bytes_sent - before)
        saved = job.full()
    frozen = objects_of(root, GEN[3])
    assert read_mirror_state(root)["last_completed"] == GEN[3]
    mirror = ObjectStore(s3_root)
    assert {p for p in mirror.find("") if p.startswith(f"{OBJECTS_DIR}/")} == set(frozen)
    assert sent[0] > sum(frozen.values()) > max(sent[1:])
    assert list_generations(LocalStore(root)) == [GEN[3], GEN[2]]  # keep_last swept nothing shared
    assert inodes(root).keys() == set(frozen)
    restored = incremental_tiers.restore(0, 1, "plain", str(tmp_path / "gone"), mirror=s3_root)
    assert restored["generation"] == GEN[3]
    assert_same(saved, restored["full"])
