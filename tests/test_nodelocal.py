"""Two "nodes" with their own local disks behind the same path and one shared S3 mirror.

Each node is a torchrun invocation (``--nnodes 2``, one rank each, on loopback) in its own
mount namespace, where the checkpoint path is bind-mounted onto that node's directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dist_ckpt.testing import free_port

pytestmark = pytest.mark.launcher  # torchrun jobs as two nodes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_two_nodes(base: str, mirror: str, phase: str) -> list[dict]:
    mount_point = os.path.join(base, "ckpt")
    reference = os.path.join(base, "reference.pt")
    port = free_port()
    procs = []
    for node in (0, 1):
        disk = os.path.join(base, f"node{node}")
        os.makedirs(disk, exist_ok=True)
        torchrun = (f"{sys.executable} -m torch.distributed.run --nnodes 2 --node-rank {node} "
                    f"--nproc-per-node 1 --master-addr 127.0.0.1 --master-port {port} "
                    f"tests/helpers/nodelocal_job.py {mount_point} {mirror} {reference} {phase}")
        script = f"mount --bind {disk} {mount_point} && exec {torchrun}"
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output[-4000:]
        results += [json.loads(line[len("RESULT "):]) for line in output.splitlines()
                    if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])


def test_replaced_node_restores_from_the_mirror(s3_root: str, tmp_path) -> None:
    base = str(tmp_path)
    os.makedirs(os.path.join(base, "ckpt"))
    run_two_nodes(base, s3_root, "save")
    node0, node1 = os.path.join(base, "node0"), os.path.join(base, "node1")
    # each node published its own copy of the generation, holding only its own shards
    for disk, rank in ((node0, 0), (node1, 1)):
        shards = os.listdir(os.path.join(disk, "gen-000000000004", "dcp"))
        assert f"__{rank}_0.distcp" in shards and f"__{1 - rank}_0.distcp" not in shards
    shutil.rmtree(node1)  # node 1 is a replaced machine
    results = run_two_nodes(base, s3_root, "restore")
    assert [r["generation"] for r in results] == ["gen-000000000004"] * 2
    assert results[0]["same"] is True
