"""Two launchers as two nodes: node-local ROOTs, one S3 mirror, every worker of node 1 killed.

Each node is a ``python -m launch --nnodes 2 --rdzv-backend c10d`` process in its own mount
namespace, where the checkpoint path is bind-mounted onto that node's own directory. The
crash marker is pre-created on node 0's disk, so only node 1's worker kills itself (SIGKILL)
on the first start, once the mirror holds generation 4. Both launchers must restart, resume
from the same generation (the newest one both nodes can reach: node-local copies hold one
node's shards each, so it comes from the mirror) and finish with a DONE record on each node.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from dist_ckpt.testing import free_port
from tests.helpers import launchlib
from tests.helpers.launchlib import read_log

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600), pytest.mark.long(
    reason="two launchers as two nodes, each starting torchrun's agent and a worker twice: "
           "four chains of fresh interpreters importing torch, about half a minute on an idle "
           "2-core machine and more beside other tests")]


def test_two_nodes_restart_after_node1_loses_its_workers(s3_root: str, tmp_path) -> None:
    mount_point = tmp_path / "ckpt"
    mount_point.mkdir()
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for disk in disks:
        disk.mkdir()
    (disks[0] / "crashed").touch()  # node 0 never crashes
    port = free_port()
    procs = []
    for disk in disks:
        command = launchlib.command(
            str(mount_point), "--mirror", s3_root, "--run-id", "job", "--backoff", "1", nproc=1,
            nnodes=2, rdzv_port=port, rdzv_id="two-nodes",
            script_args=("--updates", "8", "--save-every", "2", "--crash-at", "5",
                         "--crash-rank", "-1", "--crash-marker", str(mount_point / "crashed"),
                         "--crash-after-mirrored"))
        script = f"mount --bind {disk} {mount_point} && exec {' '.join(command)}"
        procs.append(subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd=launchlib.REPO,
                                      env=launchlib.env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=420)[0])
    finally:
        for proc in procs:
            proc.kill()
    for node, output in enumerate(outputs):
        (tmp_path / f"node{node}.log").write_text(output)
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-4000:]
    logs = [read_log(str(disk)) for disk in disks]
    for log in logs:
        assert [s["classification"] for s in log] == ["transient", "done"], log
        assert log[0]["resumed_from"] == "fresh"
    assert "killed by SIGKILL" in logs[1][0]["reason"]
    assert {log[1]["resumed_from"] for log in logs} == {"gen-000000000004"}, logs
    done = [json.load(open(disk / "runs" / "job" / "DONE.json")) for disk in disks]
    assert done[0]["generation"] == done[1]["generation"] == "gen-000000000008"
    assert done[0]["manifest_sha256"] == done[1]["manifest_sha256"]
    assert os.path.exists(disks[1] / "crashed")
