"""``CheckpointManager.wait()`` drains the retention passes its saves queued, not only the saves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, faults
from tests.helpers.local_jobs import make_state, step


@pytest.fixture
def slow_prune() -> Iterator[None]:
    # each deletion takes a while: a wait() that returned before the pass would see 4 or 5
    faults.configure({"prune.between": {"delay_s": 0.3}})
    yield
    faults.configure(None)


def test_wait_returns_after_retention(tmp_path, slow_prune: None) -> None:
    state = make_state()
    config = CheckpointConfig(root=str(tmp_path), keep_last=3, async_save=True)
    with CheckpointManager(config, state) as mgr:
        for update in range(1, 6):
            step(state)
            mgr.save(update)
            mgr.wait()
            committed = [g.name for g in mgr.generations() if g.state == "committed"]
            assert len(committed) == min(update, 3), committed
