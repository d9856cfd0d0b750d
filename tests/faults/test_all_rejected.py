"""Every committed generation rejected: restore never starts over silently (issue 38). It
raises NoValidGeneration naming each generation and why, moving none aside, so the next start
sees them too; starting over is the caller's explicit choice. A directory without a manifest
(never committed) is no progress of the run: a fresh start without it is no loss."""

from __future__ import annotations

import os

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, NoValidGeneration
from dist_ckpt.format.manifest import REJECTED_DIR, generation_name
from dist_ckpt.runinfo import PERMANENT_ERRORS, error_name
from launch.policy import permanent_reason
from tests.helpers.local_jobs import damage, make_state, two_generations
from tests.helpers.matrix import record, timed

GEN1, GEN2 = generation_name(1), generation_name(2)


def damaged_root(tmp_path) -> str:
    root = str(tmp_path / "root")
    two_generations(root)
    for name in (GEN1, GEN2):
        damage(os.path.join(root, name, "dcp", "__0_0.distcp"), "bitflip")
    return root


def test_every_generation_rejected_raises_and_moves_nothing(tmp_path) -> None:
    root = damaged_root(tmp_path)
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        with pytest.raises(NoValidGeneration) as caught:
            mgr.restore()
    error = caught.value
    assert [line.split(" ", 1)[0].rstrip(":") for line in error.rejected] == [GEN2, GEN1]
    assert all("__0_0.distcp" in line for line in error.rejected)
    assert "nothing was moved aside" in str(error) and "on_all_rejected" in str(error)
    assert os.path.isdir(os.path.join(root, GEN1)) and os.path.isdir(os.path.join(root, GEN2))
    assert not os.path.exists(os.path.join(root, REJECTED_DIR))
    # the launcher stops on it (permanent), with the whole reason and where to go from here
    assert isinstance(error, PERMANENT_ERRORS)
    report = {"failure": {"error": error_name(error), "message": str(error), "permanent": True}}
    reason = permanent_reason({0: report})  # type: ignore[dict-item]
    assert reason is not None and GEN1 in reason and GEN2 in reason and "--fresh" in reason
    record("every committed generation rejected",
           observed=f"NoValidGeneration naming {GEN2}, {GEN1}; nothing moved aside")


@pytest.mark.parametrize("where", ["argument", "config"])
def test_starting_over_is_an_explicit_choice(tmp_path, where: str) -> None:
    root = damaged_root(tmp_path)
    config = CheckpointConfig(root=root, **({"on_all_rejected": "fresh"} if where == "config" else {}))
    with CheckpointManager(config, make_state()) as mgr:
        result, seconds = timed(lambda: mgr.restore(**({"on_all_rejected": "fresh"}
                                                       if where == "argument" else {})))
    assert result.fresh and [p.generation for p in result.rejected] == [GEN2, GEN1]
    assert sorted(os.listdir(os.path.join(root, REJECTED_DIR)))[0].startswith(GEN1)
    record("every committed generation rejected",
           observed=f"on_all_rejected='fresh' ({where}): fresh start, both moved aside",
           recover_s=round(seconds, 3))


def test_a_directory_that_was_never_committed_is_no_progress(tmp_path) -> None:
    root = str(tmp_path / "root")
    os.makedirs(os.path.join(root, GEN1, "dcp"))  # a save cut short on a store without rename
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        result = mgr.restore()
    assert result.fresh and [p.generation for p in result.rejected] == [GEN1]
    assert not result.rejected[0].committed
