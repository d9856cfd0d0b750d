"""The fault-injection mechanism itself (``dist_ckpt.faults``): filtering, blocking points
released by events (in-process and across processes), the block timeout, the off path, and
that every named point of the save, commit, mirror, prune and restore paths fires."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, faults
from dist_ckpt.faults import FaultInjected
from dist_ckpt.format.validate import read_manifest
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers.local_jobs import make_state, step

REPO = Path(__file__).resolve().parents[2]
COUNT_ONLY = {"after": 10**9}  # a spec that never acts: hits() counts its point


@pytest.fixture(autouse=True)
def clean_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.delenv(faults.DIR_ENV, raising=False)
    faults.configure(None)
    yield
    faults.configure(None)


def test_off_path_returns_empty_and_counts_nothing() -> None:
    assert faults.hit("write.before", 0) == {}
    assert faults.hit("write.before") == {}
    faults.configure({})
    assert faults.hit("write.before", 3) == {}
    faults.configure({"commit.before_rename": {"raise": True}})
    assert faults.hit("write.before", 0) == {}  # another point's spec does not fire here
    assert faults.hits() == {}


def test_environment_spec_is_read_while_nothing_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, json.dumps({"upload.file": {"rank": 1, "truncate": True}}))
    assert faults.hit("upload.file", 0) == {}
    assert faults.hit("upload.file", 1).get("truncate") is True
    faults.configure({})  # a configuration replaces the environment's
    assert faults.hit("upload.file", 1) == {}


def test_rank_and_after_filtering() -> None:
    faults.configure({"report.before": {"rank": [1, 2], "after": 2, "raise": True}})
    assert faults.hit("report.before", 0) == {}  # another rank: neither fires nor counts
    assert faults.hits() == {}
    assert faults.hit("report.before", 1) == {}  # `after` lets two matching hits pass
    assert faults.hit("report.before", 2) == {}
    with pytest.raises(FaultInjected, match="report.before on rank 1"):
        faults.hit("report.before", 1)
    assert faults.hits() == {"report.before": 3}
    faults.configure({"report.before": {"rank": 1, "raise": True}})  # an int; counts reset
    assert faults.hits() == {}
    assert faults.hit("report.before", 0) == {}
    with pytest.raises(FaultInjected):
        faults.hit("report.before", 1)


def test_a_point_without_a_rank_uses_the_process_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        own = dist.get_rank()
    else:
        monkeypatch.setenv("RANK", "1")
        own = 1
    faults.configure({"prune.between": {"rank": own, "raise": True}})
    with pytest.raises(FaultInjected, match=f"on rank {own}"):
        faults.hit("prune.between")
    faults.configure({"prune.between": {"rank": own + 1, "raise": True}})
    assert faults.hit("prune.between") == {}


def test_block_timeout_raises() -> None:
    faults.configure({"commit.collected": {"block": "never", "block_timeout_s": 0.2}})
    with pytest.raises(FaultInjected, match="'never' was not released"):
        faults.hit("commit.collected", 0)
    assert faults.reached("never") == [0]


def test_a_block_released_first_does_not_block() -> None:
    faults.configure({"restore.selected": {"block": True, "block_timeout_s": 0.2}})  # name: the point's
    faults.release("restore.selected")
    assert faults.hit("restore.selected", 0)["block"] is True
    assert faults.reached("restore.selected") == [0]


def test_reconfiguring_lets_blocked_points_go_on() -> None:
    faults.configure({"write.after": {"block": "stuck"}})
    thread = threading.Thread(target=faults.hit, args=("write.after", 0), daemon=True)
    thread.start()
    faults.wait_reached("stuck", rank=0, timeout_s=30)
    assert thread.is_alive()
    faults.configure(None)  # a test's cleanup never leaves a thread blocked
    thread.join(30)
    assert not thread.is_alive()


def test_two_threads_of_one_rank_are_counted_apart() -> None:
    faults.configure({"commit.before_manifest": {"block": "pair"}})
    threads = [threading.Thread(target=faults.hit, args=("commit.before_manifest", 0), daemon=True)
               for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        assert faults.wait_reached("pair", count=2, timeout_s=30) == [0, 0]
        assert all(thread.is_alive() for thread in threads)
    finally:
        faults.release("pair")
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    with pytest.raises(TimeoutError, match="rank"):
        faults.wait_reached("pair", rank=1, timeout_s=0.05)


def test_a_blocked_writer_waits_for_its_release(tmp_path: Path) -> None:
    marks = tmp_path / "faults"
    faults.configure({"write.before": {"block": "held"}, "write.after": COUNT_ONLY},
                     fault_dir=str(marks))
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=str(tmp_path / "root"), async_save=True), state) as mgr:
        step(state)
        job = mgr.save(1)
        try:
            assert faults.wait_reached("held", rank=0, timeout_s=60) == [0]
            assert (marks / "held.reached.0").exists() and not (marks / "held.release").exists()
            # the writer has not passed the point: nothing written, nothing committed
            assert not job.done.is_set()
            assert faults.hits().get("write.after", 0) == 0
            assert not [g for g in mgr.generations() if g.state == "committed"]
        finally:
            faults.release("held")
        assert (marks / "held.release").exists()
        mgr.wait()
        assert job.committed and faults.hits()["write.after"] == 1
        assert [g.name for g in mgr.generations() if g.state == "committed"] == ["gen-000000000001"]


@pytest.mark.processes
def test_a_block_across_processes(tmp_path: Path) -> None:
    marks = str(tmp_path / "faults")
    env = dict(os.environ, **{faults.ENV: json.dumps({"report.before": {"rank": 1, "block": "r"}}),
                              faults.DIR_ENV: marks})
    script = ("from dist_ckpt import faults\n"
              "faults.hit('report.before', 0)\n"  # another rank: passes
              "print('rank 0 passed', flush=True)\n"
              "faults.hit('report.before', 1)\n"
              "print('rank 1 released', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert faults.wait_reached("r", rank=1, timeout_s=120, fault_dir=marks) == [1]
        assert proc.poll() is None  # held at the point
    finally:
        faults.release("r", fault_dir=marks)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["rank 0 passed", "rank 1 released"]


LOCAL_POINTS = {  # hits on one rank: two saves (the second prunes the first), two restores
    "stage.before": 2, "write.before": 2, "write.after": 2, "report.before": 2,
    "commit.collected": 2, "commit.before_manifest": 2, "commit.before_rename": 2,
    "commit.after_rename": 2, "commit.before_latest": 2, "prune.between": 1,
    "restore.selected": 2, "restore.before_load": 1,
}


def test_every_point_of_the_local_paths_fires(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    faults.configure({point: COUNT_ONLY for point in LOCAL_POINTS})
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        assert mgr.restore().generation is None  # a fresh start: selected, nothing to load
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, keep_last=1), state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        assert mgr.restore().generation == "gen-000000000002"
    assert faults.hits() == LOCAL_POINTS


@pytest.mark.processes
def test_every_point_of_the_mirror_path_fires(tmp_path: Path, s3_root: str) -> None:
    points = ["mirror.upload", "mirror.before_publish", "upload.file", "commit.before_rename",
              "commit.after_rename"]
    faults.configure({point: COUNT_ONLY for point in points})
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=str(tmp_path / "root"), mirror=s3_root), state) as mgr:
        step(state)
        mgr.save(1)
        assert mgr.replayer.drain(60)
    hits = faults.hits()
    assert hits["mirror.upload"] == 1 and hits["mirror.before_publish"] == 1
    # the local rename and the mirror's conditional create
    assert hits["commit.before_rename"] == 2 and hits["commit.after_rename"] == 2
    remote = read_manifest(ObjectStore(s3_root), "gen-000000000001")
    assert hits["upload.file"] == len(remote.files)  # one per object the rank replayed
