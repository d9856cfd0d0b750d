"""A prune SIGKILLed between and inside deletions, and two jobs writing one root."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, GenerationExists, cli
from dist_ckpt.format.inventory import inventory
from dist_ckpt.format.manifest import generation_name
from dist_ckpt.format.validate import validate
from dist_ckpt.tiers import open_tier
from tests.helpers.local_jobs import make_state, step
from tests.helpers.matrix import record, timed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generations(root: str, updates: list[int]) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, async_save=False), state) as mgr:
        for update in updates:
            step(state)
            mgr.save(update)


def cli_killed_at(point: str, *argv: str) -> int:
    env = dict(os.environ, DIST_CKPT_FAULTS=json.dumps({point: {"kill": True}}), PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "dist_ckpt.cli", *argv], env=env, timeout=120,
                          capture_output=True).returncode


@pytest.mark.processes
@pytest.mark.parametrize("point", ["prune.manifest_removed", "prune.between"])
def test_prune_killed_mid_way(tmp_path, point: str) -> None:
    root = str(tmp_path)
    generations(root, [1, 2, 3, 4])
    assert cli_killed_at(point, "prune", root, "--keep-last", "2") == -9
    infos = {i.name: i for i in inventory(open_tier(root).store, digests=True)}
    kept = [generation_name(3), generation_name(4)]
    assert all(infos[name].state == "committed" for name in kept)  # every kept one valid
    committed = sorted(n for n, i in infos.items() if i.state == "committed")
    half = [n for n, i in infos.items() if i.state != "committed"]
    # the half-deleted one (no manifest, files left) is never listed as committed
    assert committed == sorted(set(committed) & {generation_name(u) for u in (1, 2, 3, 4)})
    if point == "prune.manifest_removed":  # retention deletes the newest droppable first
        assert half == [generation_name(2)] and generation_name(2) not in committed
    # the next prune, in-process: only the killed one is about a process
    code, recover_s = timed(lambda: cli.main(["prune", root, "--keep-last", "2"]))
    assert code == 0
    left = {i.name: i.state for i in inventory(open_tier(root).store, digests=True)}
    assert left == {name: "committed" for name in kept}  # the next prune finished the deletion
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        assert mgr.restore().generation == generation_name(4)
    record("crash during prune", observed=f"SIGKILL at {point}: kept {kept} valid, "
           f"half-deleted {half or 'none'} never committed", recover_s=round(recover_s, 3), point=point)


def test_two_jobs_on_one_root(tmp_path) -> None:
    """Two jobs save into one root: the second writer of a generation gets GenerationExists,
    and generations of both jobs coexist, each complete. (Retention is per root: a job with
    keep_last counts the other job's generations too; see docs/guarantees.md.)"""
    root = str(tmp_path)
    first, second = make_state(), make_state()
    config = CheckpointConfig(root=root, async_save=False)
    with CheckpointManager(config, first) as job_a, CheckpointManager(config, second) as job_b:
        step(first)
        job_a.save(1)
        step(second)
        with pytest.raises(GenerationExists):
            job_b.save(1)  # same generation: the loser is told, nothing is mixed
        job_b.save(2)  # a different generation: both coexist
        job_a.save(3)
    store = open_tier(root).store
    for name in (generation_name(1), generation_name(2), generation_name(3)):
        validate(store, name, digests=True)
    record("concurrent writers on one root", observed="second writer of gen 1 got GenerationExists; "
           "gens 1, 2, 3 from two jobs all valid")
