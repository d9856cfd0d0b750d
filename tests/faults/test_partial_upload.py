"""Partial remote uploads: an uploader killed mid-generation, a truncated object; neither is
ever recorded as remotely complete."""

from __future__ import annotations

import json
import signal

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.replay.record import read_mirror_state
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers.local_jobs import make_state
from tests.helpers.mirror_runs import FILES_PER_GENERATION, remote_states, run_job


def test_uploader_killed_mid_generation(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "local")
    kill_on = {"upload.file": {"after": FILES_PER_GENERATION + 1, "kill": True}}
    proc = run_job(root, s3_root, [1, 2], kill_on)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    backend = ObjectStore(s3_root)
    arrived = backend.fs.find(f"{backend.base}/gen-000000000002")
    assert 0 < len(arrived) < FILES_PER_GENERATION  # some but not all objects arrived
    assert remote_states(s3_root) == {"gen-000000000001": "committed", "gen-000000000002": "invalid"}
    assert read_mirror_state(root)["last_completed"] == "gen-000000000001"
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000001"
    with CheckpointManager(CheckpointConfig(root=str(tmp_path / "empty"), mirror=s3_root),
                           make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000001"


def test_truncated_object_is_never_committed(s3_root: str, tmp_path) -> None:
    root = str(tmp_path / "local")
    proc = run_job(root, s3_root, [1, 2], {"upload.file": {"after": FILES_PER_GENERATION + 1,
                                                           "truncate": True}})
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["completed"] == ["gen-000000000001"] and figures["failed"] == ["gen-000000000002"]
    assert remote_states(s3_root)["gen-000000000002"] != "committed"
    assert read_mirror_state(root)["last_completed"] == "gen-000000000001"
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000001"
