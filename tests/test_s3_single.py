"""Object-store generations in one process: save, restore, fallback, CLI, conflicts."""

from __future__ import annotations

import torch

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.cli.app import main as cli
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers.local_jobs import make_state, step


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


def test_pruner_removes_leftovers_of_failed_uploads_only(s3_root: str) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root), state) as mgr:
        for update in (1, 4):
            step(state)
            mgr.save(update)
    backend = ObjectStore(s3_root)
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


