"""The commit-tier contract, run against every tier: the two real ones (rename, object
store) and a test-only dict-backed tier registered from ``tests/helpers/dict_tier.py``,
which shows that a new tier is one module plus ``register_tier``."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, GenerationExists
from dist_ckpt.format.inventory import inventory
from dist_ckpt.format.manifest import MANIFEST_NAME, Manifest, generation_name, read_latest_name
from dist_ckpt.format.validate import validate
from dist_ckpt.tiers import CommitTier, TierOptions, open_tier
from tests.helpers import dict_tier
from tests.helpers.local_jobs import make_state, step, two_generations

TIERS = ("rename", "objectstore", "dict")


@pytest.fixture(params=[pytest.param(tier, marks=pytest.mark.processes) if tier == "objectstore"
                        else tier for tier in TIERS])  # the object store is a moto_server
def root(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "rename":
        return str(tmp_path / "root")
    if request.param == "objectstore":
        return request.getfixturevalue("s3_root")
    return f"{dict_tier.SCHEME}{uuid.uuid4().hex[:8]}"


def tier_of(root: str, tmp_path) -> CommitTier:
    return open_tier(root, TierOptions(scratch_root=str(tmp_path / "scratch")))


def params(state) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def test_commit_then_restore(root: str, tmp_path) -> None:
    saved = two_generations(root, cache_dir=str(tmp_path / "cache"))
    tier = tier_of(root, tmp_path)
    states = {i.name: i.state for i in inventory(tier.store, digests=True)}
    assert states == {generation_name(1): "committed", generation_name(2): "committed"}
    assert read_latest_name(tier.store) == generation_name(2)
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=root, cache_dir=str(tmp_path / "cache")), fresh) as mgr:
        result = mgr.restore()
    assert result.generation == generation_name(2) and result.next_update == 2
    assert all(torch.equal(a, b) for a, b in zip(params(saved), params(fresh), strict=True))


def test_restore_falls_back_past_a_damaged_shard(root: str, tmp_path) -> None:
    two_generations(root, cache_dir=str(tmp_path / "cache"))
    tier = tier_of(root, tmp_path)
    newest = generation_name(2)
    manifest = Manifest.from_bytes(tier.store.read_bytes(f"{newest}/{MANIFEST_NAME}"), generation=newest)
    shard = next(f for f in manifest.files if f.path.startswith("dcp/") and f.path.endswith(".distcp"))
    rel = f"{newest}/{manifest.location(shard.path)}"
    damaged = bytearray(tier.store.read_bytes(rel))
    damaged[len(damaged) // 2] ^= 0xFF  # same size: only the digest can tell
    tier.store.put_bytes(rel, bytes(damaged))
    config = CheckpointConfig(root=root, cache_dir=str(tmp_path / "cache"))
    with CheckpointManager(config, make_state()) as mgr:
        result = mgr.restore()
    assert result.generation == generation_name(1)
    assert [(p.generation, p.path) for p in result.rejected] == [(newest, shard.path)]


def test_concurrent_writers_one_wins_nothing_mixes(root: str, tmp_path) -> None:
    """Two attempts of one generation both upload, then both publish: exactly one commits,
    the loser gets GenerationExists, and the committed generation is the winner's, whole."""
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, cache_dir=str(tmp_path / "cache")), state) as mgr:
        step(state)
        mgr.save(1)
    tier = tier_of(root, tmp_path)
    source = Manifest.from_bytes(tier.store.read_bytes(f"{generation_name(1)}/{MANIFEST_NAME}"),
                                 generation=generation_name(1))
    target = generation_name(7)
    attempts = [tier.begin(target, uuid.uuid4().hex[:8]) for _ in range(2)]
    entries = [f.model_dump() for f in source.files]
    for attempt in attempts:
        for entry in entries:
            local = os.path.join(attempt.local_dir, entry["path"])
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local, "wb") as handle:
                handle.write(tier.store.read_bytes(f"{source.generation}/{source.location(entry['path'])}"))
        attempt.put_files(entries)
    winner, loser = attempts
    manifest = source.model_copy(update={"generation": target, "next_update": 7, "data_dir": winner.data_dir})
    winner.publish(manifest, None)
    with pytest.raises(GenerationExists):
        loser.publish(manifest.model_copy(update={"data_dir": loser.data_dir}), None)
    loser.abandon()
    committed = validate(tier.store, target, digests=True)
    assert committed.data_dir == winner.data_dir
    assert read_latest_name(tier.store) == target
    if loser.data_dir:  # tiers without rename keep each attempt apart: the loser's is gone
        assert not tier.store.exists(f"{target}/{loser.data_dir}")
    assert not os.path.exists(loser.local_dir)
