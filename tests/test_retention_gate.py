"""``require_rehearsal`` holds on every retention path (one owner: dist_ckpt/lifecycle/pruning.py):
the root without and with the memory tier, and the mirror. While the root's newest committed
generation has not passed a rehearsal nothing durable is deleted; the same job without the
requirement prunes each tier to its count (the control: the pass ran and would have deleted).
That a rehearsal of the newest generation unlocks retention: tests/test_rehearse.py."""

from __future__ import annotations

import os
import uuid

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, runinfo
from tests.helpers.local_jobs import make_state, step
from tests.helpers.mirror_runs import remote_states

GENS = [f"gen-{n:012d}" for n in range(1, 4)]


def on_root(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("gen-"))


def save_updates(config: CheckpointConfig, updates: tuple[int, ...]) -> None:
    """Saves of ``updates``, each replayed to its end."""
    with CheckpointManager(config, make_state()) as mgr:
        for update in updates:
            step(mgr.state)
            mgr.save(update)
            mgr.wait()
            if mgr.replayer is not None:
                assert mgr.replayer.drain(60)


@pytest.fixture
def run_id(monkeypatch) -> None:
    monkeypatch.setenv(runinfo.RUN_ID_ENV, f"gate-{uuid.uuid4().hex[:8]}")  # the memory tier's


@pytest.mark.parametrize("memory_tier", [False, True], ids=["root", "root-behind-memory"])
@pytest.mark.parametrize("required", [True, False], ids=["required", "control"])
def test_the_root_keeps_everything_until_a_rehearsal(tmp_path, run_id, memory_tier: bool,
                                                     required: bool) -> None:
    root = str(tmp_path / "root")
    tier = {"memory_tier": True, "persist_every": 1} if memory_tier else {}
    config = CheckpointConfig(root=root, keep_last=1, require_rehearsal=required, **tier)
    save_updates(config, (1, 2, 3))
    assert on_root(root) == (GENS[:3] if required else GENS[2:3])


@pytest.mark.parametrize("required", [True, False], ids=["required", "control"])
def test_the_mirror_keeps_everything_until_a_rehearsal(tmp_path, s3_root: str, required: bool) -> None:
    root = str(tmp_path / "root")
    config = CheckpointConfig(root=root, mirror=s3_root, mirror_keep_last=1, require_rehearsal=required)
    save_updates(config, (1, 2, 3))
    assert sorted(remote_states(s3_root)) == (GENS[:3] if required else GENS[2:3])
