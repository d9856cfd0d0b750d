"""Incremental generations and the object-store mirror (issue 28, item 4 and the bit-flip
acceptance): each shared object goes up once, to ``objects/<name>`` at the mirror's root; a
generation is published there, and recorded as completed, only once every object it lists is
there; a generation restores bitwise from the mirror alone; a damaged object in the root fails
every generation that lists it, and restore repairs it from the mirror or falls back past them.

Single-rank jobs run in this process (no process group), against the session's moto server."""

from __future__ import annotations

import os
import shutil

import pytest

from dist_ckpt.errors import NoValidGeneration, ValidationError
from dist_ckpt.format.manifest import LATEST_NAME, MANIFEST_NAME, OBJECTS_DIR, REJECTED_DIR
from dist_ckpt.format.objects import COPIES_DIR
from dist_ckpt.format.validate import validate
from dist_ckpt.replay.record import read_mirror_state
from dist_ckpt.storage.local import LocalStore, file_digest
from dist_ckpt.storage.objectstore import ObjectStore
from dist_ckpt.testing import run_ranks
from dist_ckpt.tiers import objectstore as objectstore_tier
from tests.helpers import incremental_tiers
from tests.helpers.finetune_jobs import Job, manager
from tests.helpers.incremental_tiers import assert_same, flip_byte, objects_of, own_bytes, train

GEN1, GEN2, GEN3 = (f"gen-{n:012d}" for n in (1, 2, 3))


def mirrored_saves(root: str, mirror: str, updates: list[int], **config) -> tuple[dict, dict[int, int]]:
    """A one-rank fine-tuning job saving at each update and waiting for each upload; returns
    the full state at each save and the bytes sent to the mirror for each generation."""
    job = Job("plain", 0, 1)
    full, sent = {}, {}
    with manager(job, root, mirror=mirror, **config) as mgr:
        store = mgr.tiers.mirror.store
        for update in range(1, max(updates) + 1):
            job.step()
            if update in updates:
                before = store.bytes_sent
                mgr.save(update)
                mgr.wait()
                assert mgr.replayer.drain(60)
                sent[update] = store.bytes_sent - before
                full[update] = job.full()
    return full, sent


def mirror_objects(mirror: str) -> set[str]:
    return {p for p in ObjectStore(mirror).find("") if p.startswith(f"{OBJECTS_DIR}/")}


def test_each_object_is_uploaded_once(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "root")
    _, sent = mirrored_saves(root, s3_root, [1, 2, 3])
    frozen = objects_of(root, GEN1)
    assert len(frozen) == 2 and objects_of(root, GEN2) == objects_of(root, GEN3) == frozen
    assert read_mirror_state(root)["last_completed"] == GEN3
    assert not os.path.exists(os.path.join(root, COPIES_DIR))  # the mirror is the other copy
    store = ObjectStore(s3_root)
    # the objects live once, at the mirror's root: no generation's attempt holds a copy
    assert mirror_objects(s3_root) == set(frozen)
    assert not [p for p in store.find("") if f"/{OBJECTS_DIR}/" in p]
    for name, size in frozen.items():
        assert store.size(name) == size
    assert sent[1] >= sum(frozen.values()) + own_bytes(root, GEN1)
    # later generations send their own files, the manifest and the pointer: nothing shared
    for update, generation in ((2, GEN2), (3, GEN3)):
        published = len(store.read_bytes(f"{generation}/{MANIFEST_NAME}"))
        pointer = len(store.read_bytes(LATEST_NAME)) if update == 3 else None
        if pointer is not None:
            assert sent[update] == own_bytes(root, generation) + published + pointer
        assert sent[update] < sum(frozen.values())
        assert sent[update] - own_bytes(root, generation) < 16 << 10


def test_a_missing_object_fails_the_replay(s3_root: str, tmp_path, monkeypatch) -> None:
    """An object the upload skipped (as if the mirror held it) is found missing before the
    manifest goes up: nothing is published, mirror.json records a failure, not a completion;
    the next generation uploads what the mirror lacks and completes."""
    root = str(tmp_path / "root")
    job = Job("plain", 0, 1)
    with manager(job, root, mirror=s3_root) as mgr:
        monkeypatch.setattr(objectstore_tier, "holds_object", lambda store, entry: True)
        job.step()
        mgr.save(1)
        mgr.wait()
        assert mgr.replayer.drain(60)
        state = read_mirror_state(root)
        assert "last_completed" not in state and state["failed"] == [GEN1]
        assert "lacks 2 shared object(s)" in state["last_failure"]["reason"]
        assert not ObjectStore(s3_root).exists(f"{GEN1}/{MANIFEST_NAME}")
        assert mirror_objects(s3_root) == set()
        monkeypatch.undo()
        job.step()
        mgr.save(2)
        mgr.wait()
        assert mgr.replayer.drain(60)
        saved = job.full()
    assert read_mirror_state(root)["last_completed"] == GEN2
    assert mirror_objects(s3_root) == set(objects_of(root, GEN2))
    shutil.rmtree(root)
    restored = incremental_tiers.restore(0, 1, "plain", root, mirror=s3_root)
    assert restored["generation"] == GEN2
    assert_same(saved, restored["full"])


def test_restore_from_the_mirror_after_losing_the_root(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "root")
    full, _ = mirrored_saves(root, s3_root, [1, 2])
    shutil.rmtree(root)  # a replaced machine: only the mirror is left
    restored = incremental_tiers.restore(0, 1, "plain", root, mirror=s3_root)
    assert (restored["generation"], restored["tier"]) == (GEN2, "object store")
    assert_same(full[2], restored["full"])
    # the first generation, complete by itself in the mirror too
    ObjectStore(s3_root).remove_tree(GEN2)
    restored = incremental_tiers.restore(0, 1, "plain", root, mirror=s3_root)
    assert restored["generation"] == GEN1
    assert_same(full[1], restored["full"])


@pytest.mark.processes
def test_two_fsdp_ranks_upload_their_own_objects_and_restore_from_the_mirror(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "root")
    config = {"mirror": s3_root}
    saved = run_ranks(2, incremental_tiers.train, "fsdp", root, [1, 2], config)[0]
    frozen = objects_of(root, GEN2)
    assert len(frozen) == 4 and objects_of(root, GEN1) == frozen
    assert {f["rank"] for f in incremental_tiers.manifest(root, GEN2)["files"]
            if f["path"] in frozen} == {0, 1}
    assert read_mirror_state(root)["last_completed"] == GEN2
    assert mirror_objects(s3_root) == set(frozen)
    shutil.rmtree(root)
    restored = run_ranks(2, incremental_tiers.restore_with, "fsdp", root, config)
    assert {r["generation"] for r in restored} == {GEN2}
    assert_same(saved["full"][2], restored[0]["full"])


# ---- a bit flip in a shared object ----------------------------------------------------------
def damage_first_object(root: str, generation: str) -> tuple[str, bytes]:
    path = sorted(objects_of(root, generation))[0]
    return path, flip_byte(os.path.join(root, path))


def test_a_flipped_object_is_repaired_from_the_mirror(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "root")
    full, _ = mirrored_saves(root, s3_root, [1, 2])
    damaged, flipped = damage_first_object(root, GEN2)
    for generation in (GEN1, GEN2):  # every generation that lists it fails, naming it
        with pytest.raises(ValidationError) as failure:
            validate(LocalStore(root), generation)
        assert failure.value.path == damaged
    restored = incremental_tiers.restore(0, 1, "plain", root, mirror=s3_root)
    assert (restored["generation"], restored["tier"]) == (GEN2, "local")
    assert_same(full[2], restored["full"])
    assert restored["rejected"] == []
    ((generation, path, source, kept),) = restored["repaired"]
    assert (generation, path, source) == (GEN2, damaged, "mirror")
    # repaired in place, where every generation reads it; the damaged copy kept aside
    assert kept.startswith(os.path.join(root, REJECTED_DIR, f"{GEN2}-files-"))
    with open(os.path.join(kept, damaged), "rb") as handle:
        assert handle.read() == flipped
    for generation in (GEN1, GEN2):
        validate(LocalStore(root), generation)
    entry = next(f for f in incremental_tiers.manifest(root, GEN1)["files"] if f["path"] == damaged)
    assert file_digest(os.path.join(root, damaged), "blake3")[1] == entry["blake3"]


def test_an_object_is_repaired_from_a_mirror_without_that_generation(s3_root: str, tmp_path) -> None:
    """Objects are named by their digest: the mirror's copy serves a generation the mirror
    never received (here, one saved after the mirror was turned off)."""
    root = str(tmp_path / "root")
    mirrored_saves(root, s3_root, [1])
    train(0, 1, "plain", root, [2, 3], {"object_copies": 1})  # the mirror is off, one copy
    assert objects_of(root, GEN3) == objects_of(root, GEN1)
    damaged, _ = damage_first_object(root, GEN3)
    restored = incremental_tiers.restore(0, 1, "plain", root, mirror=s3_root)
    assert restored["generation"] == GEN3
    assert [(g, p, s) for g, p, s, _ in restored["repaired"]] == [(GEN3, damaged, "mirror")]


def test_without_a_mirror_restore_falls_back_past_every_generation_listing_it(tmp_path) -> None:
    """gen 1 full (``incremental=False``), gens 2 and 3 share the base: a flipped object sends
    restore back to gen 1; the damaged object is moved aside, so no later save or replay
    finds it in place and lists it again."""
    root = str(tmp_path / "root")
    first = train(0, 1, "plain", root, [1], {"incremental": False})
    assert objects_of(root, GEN1) == {}
    train(0, 1, "plain", root, [2, 3], {"object_copies": 1})  # no second copy on the root
    assert objects_of(root, GEN2) == objects_of(root, GEN3) != {}
    damaged, flipped = damage_first_object(root, GEN3)
    restored = incremental_tiers.restore(0, 1, "plain", root)
    assert restored["generation"] == GEN1
    assert_same(first["full"][1], restored["full"])
    assert restored["rejected"] == [(GEN3, damaged), (GEN2, damaged)]
    assert not os.path.exists(os.path.join(root, damaged))
    rejected = os.listdir(os.path.join(root, REJECTED_DIR))
    assert {GEN2, GEN3} == {name[:len(GEN1)] for name in rejected if "-files-" not in name}
    (aside,) = [name for name in rejected if "-files-" in name]
    with open(os.path.join(root, REJECTED_DIR, aside, damaged), "rb") as handle:
        assert handle.read() == flipped


def test_without_a_mirror_or_older_generation_restore_starts_fresh_only_when_asked(tmp_path) -> None:
    root = str(tmp_path / "root")
    train(0, 1, "plain", root, [1, 2], {"object_copies": 1})  # no second copy on the root
    damaged, _ = damage_first_object(root, GEN2)
    with pytest.raises(NoValidGeneration, match=GEN1):  # issue 38: never a silent fresh start
        incremental_tiers.restore(0, 1, "plain", root)
    restored = incremental_tiers.restore(0, 1, "plain", root, on_all_rejected="fresh")
    assert restored["generation"] is None
    assert restored["rejected"] == [(GEN2, damaged), (GEN1, damaged)]
