"""No single point of failure in a shared object (issue 38, item 4): on a local root that no
mirror backs, each shared object written once gets a second, separately written copy
(``ROOT/objects-copy/<name>``, listed in no manifest), so one flipped bit in the frozen base no
longer rejects every generation that references it: restore repairs the object from that copy
(checked against the manifest first, the damaged one kept under ``rejected/``) and loads the
newest generation. With both copies damaged restore rejects every generation that lists the
object, as before. ``object_copies=1`` writes no copy.

One-rank jobs run in this process (no process group)."""

from __future__ import annotations

import os

import pytest

from dist_ckpt import CheckpointConfig
from dist_ckpt.errors import ConfigError, NoValidGeneration
from dist_ckpt.format.manifest import REASON_NAME, REJECTED_DIR
from dist_ckpt.format.objects import COPIES_DIR, copy_path
from dist_ckpt.format.validate import validate
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.testing import run_ranks
from tests.helpers import incremental_tiers
from tests.helpers.finetune_jobs import Job, manager
from tests.helpers.incremental_tiers import assert_same, flip_byte, objects_of, train

GEN1, GEN2, GEN3, GEN4 = (f"gen-{n:012d}" for n in (1, 2, 3, 4))
SECOND = "root's second copy"  # the source a repair from it names


def read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def three_sharing_one_base(root: str, **config: object) -> tuple[dict, dict[str, int]]:
    """Gens 1 to 3 of one job on a local root without mirror or memory tier: gen 1 writes the
    frozen base as shared objects, gens 2 and 3 reference them. Returns the full state at
    each save and the objects."""
    saved = train(0, 1, "plain", root, [1, 2, 3], dict(config))["full"]
    frozen = objects_of(root, GEN1)
    assert frozen and objects_of(root, GEN2) == objects_of(root, GEN3) == frozen
    return saved, frozen


def test_every_object_has_a_second_copy_listed_nowhere(tmp_path) -> None:
    root = str(tmp_path / "root")
    _, frozen = three_sharing_one_base(root)
    for path in frozen:  # a separate file (its own inode) with the same bytes
        first, second = os.path.join(root, path), os.path.join(root, copy_path(path))
        assert read(second) == read(first)
        assert os.stat(second).st_ino != os.stat(first).st_ino
    assert sorted(os.listdir(os.path.join(root, COPIES_DIR))) == sorted(os.path.basename(p) for p in frozen)
    for generation in (GEN1, GEN2, GEN3):  # manifests list the objects only: the format is unchanged
        listed = [f["path"] for f in incremental_tiers.manifest(root, generation)["files"]]
        assert not [p for p in listed if p.startswith(COPIES_DIR)]
        inside = os.path.join(root, generation, COPIES_DIR)  # installed, none left behind
        assert not os.path.isdir(inside) or os.listdir(inside) == []


@pytest.mark.parametrize("how", ["bitflip", "missing"])
def test_a_damaged_object_is_repaired_from_its_second_copy(tmp_path, how: str) -> None:
    root = str(tmp_path / "root")
    saved, frozen = three_sharing_one_base(root)
    damaged = sorted(frozen)[0]
    target = os.path.join(root, damaged)
    original = read(target)
    if how == "missing":
        os.unlink(target)
    else:
        flipped = flip_byte(target)
    restored = incremental_tiers.restore(0, 1, "plain", root)
    # the newest generation, repaired in place: not an older one, not a fresh start
    assert (restored["generation"], restored["tier"]) == (GEN3, "local")
    assert_same(saved[3], restored["full"])
    assert restored["rejected"] == []
    ((generation, path, source, kept),) = restored["repaired"]
    assert (generation, path, source) == (GEN3, damaged, SECOND)
    assert read(target) == original  # bitwise the object as saved
    assert read(os.path.join(root, copy_path(damaged))) == original  # the copy is left as it was
    for name in (GEN1, GEN2, GEN3):
        validate(LocalStore(root), name)
    if how == "missing":
        assert kept is None
        return
    # the damaged bytes moved under rejected/, with the reason
    assert kept.startswith(os.path.join(root, REJECTED_DIR, f"{GEN3}-files-"))
    assert read(os.path.join(kept, damaged)) == flipped
    assert damaged in read(os.path.join(kept, REASON_NAME)).decode()


@pytest.mark.processes
def test_two_ranks_each_copy_their_objects_and_restore_repairs_one(tmp_path) -> None:
    """FSDP on 2 gloo ranks: each rank writes its shards of the base and their second copies;
    a flipped object of rank 1 is repaired by the root's holder and every rank loads gen 3."""
    root = str(tmp_path / "root")
    saved = run_ranks(2, incremental_tiers.train, "fsdp", root, [1, 2, 3])[0]["full"]
    manifest = incremental_tiers.manifest(root, GEN3)["files"]
    objects = {f["path"]: f["rank"] for f in manifest if f["path"] in objects_of(root, GEN3)}
    assert set(objects.values()) == {0, 1}
    assert all(read(os.path.join(root, copy_path(p))) == read(os.path.join(root, p)) for p in objects)
    damaged = sorted(p for p, rank in objects.items() if rank == 1)[0]
    original = read(os.path.join(root, damaged))
    flip_byte(os.path.join(root, damaged))
    restored = run_ranks(2, incremental_tiers.restore_with, "fsdp", root, {})
    for result in restored:
        assert (result["generation"], result["rejected"]) == (GEN3, [])
        assert [(g, p, s) for g, p, s, _ in result["repaired"]] == [(GEN3, damaged, SECOND)]
    assert_same(saved[3], restored[0]["full"])
    assert read(os.path.join(root, damaged)) == original


def test_a_damaged_second_copy_changes_nothing_at_restore(tmp_path) -> None:
    root = str(tmp_path / "root")
    saved, frozen = three_sharing_one_base(root)
    flip_byte(os.path.join(root, copy_path(sorted(frozen)[0])))
    restored = incremental_tiers.restore(0, 1, "plain", root)
    assert (restored["generation"], restored["rejected"], restored["repaired"]) == (GEN3, [], [])
    assert_same(saved[3], restored["full"])


def test_both_copies_damaged_fall_back_past_every_generation_listing_it(tmp_path) -> None:
    """gen 1 full (``incremental=False``), gens 2 to 4 share the base: with the object and its
    copy both flipped, restore rejects gens 4, 3, 2 and loads gen 1."""
    root = str(tmp_path / "root")
    first = train(0, 1, "plain", root, [1], {"incremental": False})["full"]
    train(0, 1, "plain", root, [2, 3, 4])
    damaged = sorted(objects_of(root, GEN4))[0]
    assert objects_of(root, GEN1) == {} and damaged in objects_of(root, GEN2)
    flip_byte(os.path.join(root, damaged))
    flip_byte(os.path.join(root, copy_path(damaged)))
    restored = incremental_tiers.restore(0, 1, "plain", root)
    assert restored["generation"] == GEN1
    assert_same(first[1], restored["full"])
    assert restored["rejected"] == [(GEN4, damaged), (GEN3, damaged), (GEN2, damaged)]
    assert restored["repaired"] == []
    assert not os.path.exists(os.path.join(root, damaged))  # moved aside, as without a copy


def test_both_copies_damaged_with_no_older_generation(tmp_path) -> None:
    """Every committed generation lists the object: restore rejects them all (it raises
    ``NoValidGeneration`` where that is restore's answer, or starts fresh listing them)."""
    root = str(tmp_path / "root")
    _, frozen = three_sharing_one_base(root)
    damaged = sorted(frozen)[0]
    flip_byte(os.path.join(root, damaged))
    flip_byte(os.path.join(root, copy_path(damaged)))
    with manager(Job("plain", 0, 1, seed=99), root) as mgr:
        try:
            result = mgr.restore()
        except NoValidGeneration as exc:
            assert all(name in str(exc) for name in (GEN1, GEN2, GEN3)), exc
            return
    assert result.generation is None
    assert [(p.generation, p.path) for p in result.rejected] == \
        [(GEN3, damaged), (GEN2, damaged), (GEN1, damaged)]


def test_one_copy_writes_none(tmp_path) -> None:
    root = str(tmp_path / "root")
    three_sharing_one_base(root, object_copies=1)
    assert not os.path.exists(os.path.join(root, COPIES_DIR))


@pytest.mark.parametrize("value", [0, 3])
def test_object_copies_is_one_or_two(tmp_path, value: int) -> None:
    with pytest.raises(ConfigError, match=f"object_copies={value}: "):
        CheckpointConfig(root=str(tmp_path), object_copies=value)
