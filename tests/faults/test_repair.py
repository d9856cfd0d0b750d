"""Repair from the nearest copy: a damaged or missing file of the newest generation in the
local root is replaced by the mirror's copy of the same save, and that generation (not its
predecessor) is restored; with no good copy anywhere restore still falls back, and a re-save
of the update in the mirror is never a source (single process, moto S3 mirror)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.errors import UnsafeFileError
from dist_ckpt.format.manifest import REASON_NAME, REJECTED_DIR, generation_name
from dist_ckpt.format.validate import read_manifest, validate
from dist_ckpt.tiers import open_tier
from dist_ckpt.tiers.base import FileRepairs
from dist_ckpt.tiers.rejected import replace_file
from tests.helpers.cli_runs import flip_byte
from tests.helpers.local_jobs import assert_same_model, make_state, step
from tests.helpers.matrix import record, timed

GEN1, GEN2 = generation_name(1), generation_name(2)
SHARD = "dcp/__0_0.distcp"
ROW = "damaged file, good copy elsewhere"


def saved_with_mirror(root: str, mirror: str, **options) -> object:
    """Two generations in ``root``, both mirrored to ``mirror`` (complete when it returns)."""
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, mirror=mirror, **options), state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
    return state  # close() waited for the mirror


def restore(root: str, mirror: str | None, **options):
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=root, mirror=mirror, **options), fresh) as mgr:
        return mgr.restore(), fresh


def quarantined(root: str) -> list[str]:
    rejected = os.path.join(root, REJECTED_DIR)
    return sorted(os.listdir(rejected)) if os.path.isdir(rejected) else []


def damage(path: str) -> None:
    flip_byte(Path(path), os.path.getsize(path) // 2)  # sizes still match: only a digest finds it


def flip_in_mirror(mirror: str, generation: str, path: str) -> None:
    store = open_tier(mirror).store
    rel = f"{generation}/{read_manifest(store, generation).location(path)}"
    raw = bytearray(store.read_bytes(rel))
    raw[len(raw) // 2] ^= 0x01
    store.put_bytes(rel, bytes(raw))


@pytest.mark.parametrize("how", ["bitflip", "missing"])
def test_damaged_shard_is_repaired_from_the_mirror(tmp_path, s3_root: str, how: str) -> None:
    root = str(tmp_path / "root")
    saved = saved_with_mirror(root, s3_root)
    target = os.path.join(root, GEN2, SHARD)
    if how == "missing":
        os.unlink(target)
    else:
        damage(target)
    (result, loaded), recover_s = timed(lambda: restore(root, s3_root))
    assert result.generation == GEN2 and result.tier == "local"  # the root, whole again
    assert result.rejected == []
    assert [(r.generation, r.path, r.source) for r in result.repaired] == [(GEN2, SHARD, "mirror")]
    assert result.repair_summary == f"repaired 1 file(s) of {GEN2} from mirror"
    assert_same_model(loaded, saved)
    validate(open_tier(root).store, GEN2)  # the installed copy is the committed bytes
    entries = quarantined(root)
    if how == "missing":
        assert entries == [] and result.repaired[0].kept is None
    else:
        [entry] = entries
        assert entry.startswith(f"{GEN2}-files-")
        assert os.path.isfile(os.path.join(root, REJECTED_DIR, entry, SHARD))  # the damaged bytes
        with open(os.path.join(root, REJECTED_DIR, entry, REASON_NAME), encoding="utf-8") as handle:
            assert SHARD in handle.read()
    assert not [n for n in os.listdir(root) if n.startswith(".pending-")]
    record(ROW, observed=f"{how} in {SHARD} of {GEN2}: {result.repair_summary}; restored {GEN2}",
           recover_s=round(recover_s, 3), how=how)


def test_damaged_metadata_is_repaired_at_selection(tmp_path, s3_root: str) -> None:
    """.metadata is hashed at selection (the shards by the load): both paths repair."""
    root = str(tmp_path / "root")
    saved_with_mirror(root, s3_root)
    damage(os.path.join(root, GEN2, "dcp/.metadata"))
    result, _ = restore(root, s3_root)
    assert result.generation == GEN2 and result.tier == "local"
    assert [(r.path, r.source) for r in result.repaired] == [("dcp/.metadata", "mirror")]


def test_no_good_copy_falls_back(tmp_path, s3_root: str) -> None:
    root = str(tmp_path / "root")
    saved_with_mirror(root, s3_root)
    damage(os.path.join(root, GEN2, SHARD))
    flip_in_mirror(s3_root, GEN2, SHARD)
    result, _ = restore(root, s3_root)
    assert result.generation == GEN1 and result.repaired == []
    assert {(p.generation, p.path) for p in result.rejected} == {(GEN2, SHARD)}
    record(ROW, observed=f"bitflip in {SHARD} of {GEN2} in root and mirror: nothing repaired; "
           f"restored {GEN1}")


def test_a_resaved_copy_is_not_a_source(tmp_path, s3_root: str) -> None:
    """The root's gen-2 is a later save of update 2 than the mirror's (another identity), with
    the same shard bytes: the mirror's shard would pass the digest check, yet it is never
    mixed into another save; the mirror's own gen-2, whole, is what loads."""
    root = str(tmp_path / "root")
    first = saved_with_mirror(root, s3_root)
    shutil.rmtree(os.path.join(root, GEN2))
    with CheckpointManager(CheckpointConfig(root=root), first) as mgr:
        mgr.save(2, tokens_seen=12345)  # the same tensors, another save
    ours = read_manifest(open_tier(root).store, GEN2)
    theirs = read_manifest(open_tier(s3_root).store, GEN2)
    assert ours.identity() != theirs.identity()
    assert ours.file(SHARD) == theirs.file(SHARD)  # a digest check alone would accept it
    damage(os.path.join(root, GEN2, SHARD))
    result, loaded = restore(root, s3_root)
    assert result.repaired == []
    assert result.generation == GEN2 and result.tier == "object store"
    assert result.next_update == 2 and result.tokens_seen != 12345
    assert_same_model(loaded, first)


def test_replace_file_keeps_the_damaged_copy_and_never_follows_a_link(tmp_path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / GEN2 / "dcp").mkdir(parents=True)
    outside.mkdir()
    (root / GEN2 / "dcp" / "a").write_bytes(b"damaged")
    fresh = tmp_path / "root" / "fresh"
    fresh.write_bytes(b"good")
    kept = replace_file(str(root), GEN2, "dcp/a", str(fresh), "digest differs")
    assert (root / GEN2 / "dcp" / "a").read_bytes() == b"good"
    assert kept is not None and os.path.basename(kept).startswith(f"{GEN2}-files-")
    assert (Path(kept) / "dcp" / "a").read_bytes() == b"damaged"
    assert "digest differs" in (Path(kept) / REASON_NAME).read_text()
    (root / GEN2 / "state").symlink_to(outside)  # a hostile root: state/ leads out of it
    fresh.write_bytes(b"good")
    with pytest.raises(UnsafeFileError):
        replace_file(str(root), GEN2, "state/b", str(fresh), "missing")
    assert os.listdir(outside) == []


def test_which_tiers_repair_in_place(tmp_path, s3_root: str) -> None:
    assert isinstance(open_tier(str(tmp_path)), FileRepairs)  # and the memory tier, a rename tier
    assert not isinstance(open_tier(s3_root), FileRepairs)
