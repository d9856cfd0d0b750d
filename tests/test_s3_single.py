"""Object-store generations in one process: save, restore, fallback, CLI, conflicts."""

from __future__ import annotations

import threading

import pytest
import torch

import dist_ckpt.restore.resume as resume_mod
from dist_ckpt import CheckpointConfig, CheckpointManager, CommitError, faults
from dist_ckpt.cli.main import main as cli
from dist_ckpt.format.validate import read_manifest
from dist_ckpt.storage.objectstore import ObjectStoreBackend
from tests.helpers.local_jobs import make_state, step, two_generations


def test_s3_round_trip_and_cli(s3_root: str, tmp_path) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root, cache_dir=str(tmp_path)), state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
        saved = {k: v.clone() for k, v in state.model.state_dict().items()}
        assert [g.name for g in mgr.generations() if g.state == "committed"] == [
            "gen-000000000002", "gen-000000000001"]
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root), fresh) as mgr:
        result = mgr.restore()
    assert result.generation == "gen-000000000002"
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, saved[key])
    assert cli(["verify", s3_root]) == 0
    assert cli(["ls", s3_root]) == 0
    assert cli(["inspect", s3_root]) == 0


def test_s3_corrupt_object_falls_back(s3_root: str) -> None:
    two_generations(s3_root)
    backend = ObjectStoreBackend(s3_root)
    manifest_files = backend.fs.find(f"{backend.base}/gen-000000000002")
    shard = next(f for f in manifest_files if f.endswith("__0_0.distcp"))
    data = backend.fs.cat_file(shard)
    backend.fs.pipe_file(shard, data[: len(data) // 2])
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        result = mgr.restore()
    assert result.generation == "gen-000000000001"
    assert result.rejected[0].generation == "gen-000000000002"
    assert cli(["verify", s3_root, "gen-000000000002"]) == 1


def test_two_writers_one_generation(s3_root: str) -> None:
    """Two jobs race to commit gen 5: both pass the existence check and upload, then the
    conditional create of the manifest lets exactly one win."""
    states = [make_state(), make_state()]
    step(states[1])
    outcomes: dict[int, str] = {}
    faults.configure({"commit.before_manifest": {"delay_s": 1.0}})  # both are past the check

    def writer(index: int) -> None:
        with CheckpointManager(CheckpointConfig(root=s3_root), states[index]) as mgr:
            try:
                mgr.save(5)
                outcomes[index] = "committed"
            except CommitError as exc:
                outcomes[index] = str(exc)

    try:
        threads = [threading.Thread(target=writer, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        faults.configure(None)
    assert sorted(outcomes) == [0, 1]
    winners = [i for i, o in outcomes.items() if o == "committed"]
    assert len(winners) == 1, outcomes
    loser = outcomes[1 - winners[0]]
    assert "GenerationExists" in loser and "another writer committed" in loser
    assert cli(["verify", s3_root, "gen-000000000005"]) == 0
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root), fresh) as mgr:
        assert mgr.restore().generation == "gen-000000000005"
    for key, value in fresh.model.state_dict().items():  # the winner's bytes, not a mix
        assert torch.equal(value, states[winners[0]].model.state_dict()[key])
    backend = ObjectStoreBackend(s3_root)
    attempts = [c for c in backend.listdir("gen-000000000005") if c.startswith("attempt-")]
    assert attempts == [read_manifest(backend, "gen-000000000005").data_dir]  # loser's removed


def test_pruner_removes_leftovers_of_failed_uploads_only(s3_root: str) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root), state) as mgr:
        for update in (1, 4):
            step(state)
            mgr.save(update)
    backend = ObjectStoreBackend(s3_root)
    backend.put_bytes("gen-000000000003/attempt-dead/dcp/__0_0.distcp", b"partial")  # crashed upload
    backend.put_bytes("gen-000000000004/attempt-lost/dcp/__0_0.distcp", b"loser")  # orphan attempt
    backend.put_bytes("gen-000000000009/attempt-live/dcp/__0_0.distcp", b"in flight")  # newer: kept
    bucket, _, prefix = backend.base.partition("/")
    backend.fs.call_s3("create_multipart_upload", Bucket=bucket,
                       Key=f"{prefix}/gen-000000000003/attempt-dead/dcp/__1_0.distcp")
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000004"  # a reader deletes nothing
    assert backend.exists("gen-000000000003/attempt-dead/dcp/__0_0.distcp")
    assert cli(["prune", s3_root, "--dry-run"]) == 0
    assert backend.exists("gen-000000000003")
    assert cli(["prune", s3_root]) == 0
    assert not backend.exists("gen-000000000003")
    assert not backend.exists("gen-000000000004/attempt-lost")
    assert backend.exists("gen-000000000009/attempt-live/dcp/__0_0.distcp")
    assert not backend.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    assert cli(["verify", s3_root, "gen-000000000004"]) == 0
    assert cli(["verify", s3_root, "gen-000000000001"]) == 0
    assert cli(["prune", s3_root, "--keep-last", "1"]) == 0
    assert not backend.exists("gen-000000000001")


@pytest.mark.parametrize("target", ["dcp/.metadata", "dcp/__0_0.distcp", "state/train_state.json"])
def test_object_swapped_after_validation_is_never_deserialised(
        s3_root: str, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    two_generations(s3_root)
    backend = ObjectStoreBackend(s3_root)
    original = resume_mod.select_generation

    def select_then_swap(*args, **kwargs):
        chosen = original(*args, **kwargs)
        manifest = chosen[1]
        key = backend._key(f"gen-000000000002/{manifest.location(target)}")
        data = bytearray(backend.fs.cat_file(key))
        data[len(data) // 2] ^= 0xFF  # same size, different bytes: a writer racing the restore
        backend.fs.pipe_file(key, bytes(data))
        return chosen

    monkeypatch.setattr(resume_mod, "select_generation", select_then_swap)
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        with pytest.raises(Exception) as caught:
            mgr.restore()
    assert "changed after validation" in str(caught.value)
    assert target.rsplit("/", 1)[-1] in str(caught.value)
