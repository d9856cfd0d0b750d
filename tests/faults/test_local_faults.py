"""Single-process fault tests: corrupt shards fall back, a failed commit publishes nothing."""

from __future__ import annotations

import os

import pytest
import torch

from dist_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    CommitError,
    ContractMismatch,
    GenerationExists,
    NotAtOptimizerBoundary,
    faults,
)
from dist_ckpt.cli.app import main as cli
from dist_ckpt.format.manifest import MANIFEST_NAME, REJECTED_DIR, read_latest_name
from dist_ckpt.testing import tree_digest
from tests.helpers.local_jobs import make_state, step, two_generations
from tests.helpers.matrix import record, timed
from tests.helpers.roots import GEN1, GEN2, TwoGenRoot

SHARD = "dcp/__0_0.distcp"


# on s3 the flipped byte only (found by the load itself, then moved aside like a truncated one)
@pytest.mark.parametrize("two_gen_root, damage", [
    ("local", "truncate"), ("local", "bitflip"),
    pytest.param("s3", "bitflip", marks=pytest.mark.processes)], indirect=["two_gen_root"])
def test_corrupt_newest_shard_falls_back(two_gen_root: TwoGenRoot, damage: str) -> None:
    """Local and s3:// roots alike: the damaged newest is rejected naming the shard, moved
    aside (kept, not deleted), and its update is saved again."""
    root = two_gen_root.url
    two_gen_root.damage(GEN2, SHARD, damage)
    assert cli(["verify", root, GEN2]) == 1
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=root), fresh) as mgr:
        result, recover_s = timed(mgr.restore)
        assert result.generation == GEN1
        assert result.next_update == 1
        assert [(p.generation, p.path) for p in result.rejected] == [(GEN2, SHARD)]
        assert not two_gen_root.store.exists(f"{GEN2}/{MANIFEST_NAME}")
        assert [n[:16] for n in two_gen_root.rejected_entries()] == [GEN2]
        assert read_latest_name(two_gen_root.store) == GEN1  # it named the generation moved
        step(fresh)
        mgr.save(2)  # the update the rejected generation held
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        again = mgr.restore()
    assert (again.generation, again.rejected) == (GEN2, [])
    record("rejected generation blocks its update",
           observed=f"{damage} in {SHARD} on a {two_gen_root.kind} root: moved aside to "
                    f"{REJECTED_DIR}/; {GEN2} saved again", recover_s=round(recover_s, 3),
           root=two_gen_root.kind, how=damage)


def test_exception_before_rename_publishes_nothing(tmp_path) -> None:
    root = str(tmp_path)
    state = two_generations(root)
    before = tree_digest(root)
    faults.configure({"commit.before_rename": {"raise": True}})
    try:
        with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
            step(state)
            with pytest.raises(CommitError) as caught:
                mgr.save(3)
            assert caught.value.failures and 0 in caught.value.failures
            infos = mgr.generations()
    finally:
        faults.configure(None)
    assert tree_digest(root) == before, "a committed generation or the pointer changed"
    assert [(g.name, g.state) for g in infos] == [("gen-000000000002", "committed"),
                                                 ("gen-000000000001", "committed")]
    assert not [n for n in os.listdir(root) if n.startswith(".pending")]


def test_mid_accumulation_save_is_refused(tmp_path) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), state) as mgr:
        state.model(torch.randn(2, 8)).sum().backward()
        with pytest.raises(NotAtOptimizerBoundary):
            mgr.save(1)
        assert mgr.generations() == []
        state.require_optimizer_boundary = False
        mgr.save(1)
        assert [g.name for g in mgr.generations()] == ["gen-000000000001"]


def test_generation_is_immutable(tmp_path) -> None:
    root = str(tmp_path)
    state = two_generations(root)
    before = tree_digest(root)
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr, pytest.raises(GenerationExists):
        mgr.save(2)
    assert tree_digest(root) == before


def test_contract_change_is_refused_unless_allowed(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    changed = make_state({"config": "v2"})
    with CheckpointManager(CheckpointConfig(root=root), changed) as mgr:
        with pytest.raises(ContractMismatch) as caught:
            mgr.restore()
        assert set(caught.value.fields) == {"config"}
        result = mgr.restore(allow_contract_change=True)
    assert result.generation == "gen-000000000002"
    assert result.contract_changes == {"config": ("v1", "v2")}


def test_fresh_start_and_numeric_order(tmp_path) -> None:
    root = str(tmp_path)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        result = mgr.restore()
        assert (result.next_update, result.generation, result.rejected) == (0, None, [])
        for update in (9, 100, 10):
            step(state)
            mgr.save(update)
        assert [g.next_update for g in mgr.generations()] == [100, 10, 9]
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000100"


def test_torch_version_mismatch_warns_or_raises(tmp_path) -> None:
    from dist_ckpt import TorchVersionMismatch
    from dist_ckpt.format.manifest import Manifest

    root = str(tmp_path)
    two_generations(root)
    path = os.path.join(root, "gen-000000000002", "manifest.json")
    with open(path, "rb") as handle:
        manifest = Manifest.model_validate_json(handle.read())
    with open(path, "wb") as handle:
        handle.write(manifest.model_copy(update={"torch_version": "1.0.0"}).to_bytes())
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr, pytest.warns(UserWarning):
        result = mgr.restore()
    assert result.generation == "gen-000000000002"
    assert any("torch 1.0.0" in note for note in result.warnings), result.warnings
    strict = CheckpointConfig(root=root, strict_torch_version=True)
    with CheckpointManager(strict, make_state()) as mgr, pytest.raises(TorchVersionMismatch):
        mgr.restore()


def test_dcp_metadata_digest_is_checked_even_without_digests(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    metadata = os.path.join(root, "gen-000000000002", "dcp", ".metadata")
    with open(metadata, "r+b") as handle:  # same size, different pickle bytes
        handle.seek(os.path.getsize(metadata) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        result = mgr.restore(verify_digests=False)
    assert result.generation == "gen-000000000001"
    assert "dcp/.metadata" in str(result.rejected[0])
