"""Nothing left behind in /tmp (issue 40 item 17): an object-store root's local scratch goes
with its manager, and torchrun's logs stay inside the launcher's start directory."""

from __future__ import annotations

import argparse
import os
import tempfile

from dist_ckpt import CheckpointConfig, CheckpointManager
from launch.agent import TORCHRUN_LOGS, keep_logs_in_start
from tests.helpers.local_jobs import make_state, step


def test_an_object_store_managers_scratch_goes_at_close(s3_root: str) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root), state) as mgr:
        scratch = os.path.join(tempfile.gettempdir(), f"dist_ckpt-scratch-{mgr.comm.session}")
        step(state)
        mgr.save(1)
        mgr.wait()
        assert os.path.isdir(scratch)  # what the save wrote before its upload
    assert not os.path.exists(scratch)
    assert [g.name for g in mgr.generations()] == ["gen-000000000001"]


def test_a_configured_cache_dir_is_the_jobs_and_stays(s3_root: str, tmp_path) -> None:
    cache = tmp_path / "cache"
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root, cache_dir=str(cache)), state) as mgr:
        step(state)
        mgr.save(1)
    assert cache.is_dir()


def test_torchrun_logs_in_the_start_directory_unless_the_job_chose() -> None:
    args = argparse.Namespace(log_dir=None)
    keep_logs_in_start(args, "/root/runs/0001/starts/3")
    assert args.log_dir == os.path.join("/root/runs/0001/starts/3", TORCHRUN_LOGS)
    chosen = argparse.Namespace(log_dir="/var/log/torch")
    keep_logs_in_start(chosen, "/root/runs/0001/starts/3")
    assert chosen.log_dir == "/var/log/torch"
    outside = argparse.Namespace(log_dir=None)
    keep_logs_in_start(outside, "")  # not under the launcher: torchrun's own default
    assert outside.log_dir is None
