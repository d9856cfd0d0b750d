"""Two launchers as two nodes on the memory tier (each its own shared-memory base, one disk
root): a node lost outright (launcher SIGKILLed, its memory gone) is rebuilt from the replica
its ring peer holds, and both nodes resume from memory, bitwise equal to an uninterrupted run.

``--persist-every 100``: until ``finish()`` the disk root holds no generation at all, so a
resume at the generation the node died after proves that nothing came from storage.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from dist_ckpt.format.manifest import parse_generation
from dist_ckpt.format.validate import list_generations
from dist_ckpt.memory import paths as shm
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.testing import free_port
from tests.helpers import launchlib
from tests.helpers.launchlib import read_log, run_dir

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(600), pytest.mark.long(
    reason="two launchers as two nodes, one killed and replaced while the other waits in the "
           "rendezvous: four chains of fresh interpreters importing torch, and the 8 s commit "
           "timeout a lost node costs its peer")]
UPDATES = 14
# a node lost while rank 0 waits for its report holds rank 0 for the commit timeout
JOB = ("--memory-tier", "--persist-every", "100", "--updates", str(UPDATES), "--save-every", "1",
       "--commit-timeout", "8")


def _node(root: str, shm_dir: str, port: int, dump: str) -> subprocess.Popen:
    command = launchlib.command(root, "--run-id", "nodes", "--backoff", "0.5", nproc=1, nnodes=2,
                                rdzv_port=port, rdzv_id="memory-nodes",
                                script_args=(*JOB, "--dump-final", dump))
    env = dict(launchlib.env(), **{shm.SHM_DIR_ENV: shm_dir})
    return subprocess.Popen(command, cwd=launchlib.REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_lost_node_resumes_from_its_peers_replica(tmp_path) -> None:
    launchlib.reference(str(tmp_path / "reference"), *JOB, "--dump-final", str(tmp_path / "reference.pt"))
    root = str(tmp_path / "root")
    shm_dirs = [str(tmp_path / f"shm{node}") for node in (0, 1)]
    for directory in shm_dirs:
        os.makedirs(directory)
    port = free_port()
    final = str(tmp_path / "final.pt")
    nodes = [_node(root, directory, port, final) for directory in shm_dirs]
    outputs: list[str] = []
    try:
        launchlib.wait_for(lambda: launchlib.newest_in_memory(shm_dirs[1]) >= 4, 240,
                           "node 1 to hold generation 4 in memory")
        lost_at = launchlib.newest_in_memory(shm_dirs[1])
        # the first start's workers (which rank landed on which node is torchrun's choice)
        workers = list(launchlib.worker_pids(root).values())
        os.killpg(nodes[1].pid, signal.SIGKILL)  # the whole node: launcher, then its workers
        outputs.append(nodes[1].communicate(timeout=60)[0])
        # as with a machine that takes minutes to replace: node 0's start failed (its peer
        # vanished) and its next torchrun waits in the rendezvous (it hosts the new store)
        launchlib.wait_for(lambda: any(s["classification"] == "transient" for s in read_log(root)),
                           90, "node 0's start to end")
        launchlib.wait_for(lambda: launchlib.all_exited(workers), 60, "the workers to exit")
        # a replaced machine: the next launcher removes what the dead one left in memory
        replacement = _node(root, shm_dirs[1], port, final)
        nodes.append(replacement)
        for proc in (nodes[0], replacement):
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    (tmp_path / "nodes.log").write_text("\n".join(outputs))
    assert nodes[0].returncode == 0 and nodes[2].returncode == 0, outputs[-1][-3000:] + outputs[-2][-3000:]
    assert "removed stale in-memory checkpoints" in outputs[2], outputs[2][-3000:]
    finished = [s for s in read_log(root) if s["classification"] == "done"]
    assert len(finished) == 2, read_log(root)
    resumed = {(s["resumed_from"], s["resumed_tier"]) for s in finished}
    assert len(resumed) == 1, resumed  # both nodes resumed from the same generation
    ((generation, tier),) = resumed
    assert tier == "memory", finished
    # at worst one generation before the newest node 1 was seen holding: its replica may
    # still have been on the way when it died, and node 0 kept its own copy of the one before
    assert parse_generation(generation) >= lost_at - 1, (generation, lost_at)
    assert list_generations(LocalStore(run_dir(root))) == [f"gen-{UPDATES:012d}"]
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    got = torch.load(final, weights_only=True)
    assert expected.keys() == got.keys() and len(got) > 4
    assert all(torch.equal(expected[k], got[k]) for k in expected), "resumed run diverged"
    # each launcher removed its run's memory before it exited (DONE)
    assert not any(os.listdir(d) for d in shm_dirs), [os.listdir(d) for d in shm_dirs]
