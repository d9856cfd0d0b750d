"""A rank SIGKILLed at each phase of a save, and rank 0 SIGKILLed at each persistence point
of its commit (2 gloo ranks, rename tier). Every case: no survivor is held past the deadline,
the restart restores a complete generation (the previous one unless the new one fully
committed), and the dead attempt's orphan is never trusted and is removed by the restart."""

from __future__ import annotations

import os

import pytest

from dist_ckpt.format.manifest import PENDING_PREFIX, generation_name, read_latest_name
from dist_ckpt.format.validate import validate
from dist_ckpt.testing import run_ranks
from dist_ckpt.tiers import open_tier
from tests.helpers import fault_jobs, killable

pytestmark = pytest.mark.processes

DEADLINE_S = 3.0  # survivors wait it out; generation 1 must commit within it beside other tests
GEN1, GEN2 = generation_name(1), generation_name(2)


def restart(root: str) -> tuple[str | None, list[str]]:
    """The job restarted on the root: what it loaded (validated again here), what it left."""
    loaded = run_ranks(2, fault_jobs.restore_only, root)[0]["generation"]
    if loaded is not None:
        validate(open_tier(root).store, loaded, digests=True)
    return loaded, sorted(os.listdir(root))


# (point, victim rank, whether generation 2 may commit: every report reached rank 0)
PHASES = [
    ("stage.before", 1, False),  # in save(), before the staging copy
    ("write.before", 1, False),  # background thread, nothing written
    ("write.shards_written", 1, False),  # mid-write: shards on disk, state files not
    ("report.before", 1, False),  # everything written and fsynced, no report
    ("report.after", 1, True),  # reported: rank 0 commits without it
]


@pytest.mark.parametrize(("point", "victim", "may_commit"), PHASES, ids=[p[0] for p in PHASES])
def test_rank_killed_at_each_phase(tmp_path, point: str, victim: int, may_commit: bool) -> None:
    root = str(tmp_path / "root")
    ranks = killable.spawn(2, fault_jobs.save_with_a_killed_rank, root, point, victim, DEADLINE_S,
                           timeout_s=120)
    outcomes = ranks.join(timeout_s=150)
    assert outcomes[victim].exitcode == -9 and outcomes[victim].result is None
    survivor = outcomes[1 - victim].result
    assert survivor is not None, f"the survivor hung or crashed: exit {outcomes[1 - victim].exitcode}"
    assert survivor["held_s"] < DEADLINE_S + 30.0  # waits end at the deadline (+ rank 0's grace)
    if not survivor["committed"]:
        assert victim in survivor["failures"], survivor["failures"]
        assert read_latest_name(open_tier(root).store) == GEN1  # the previous latest is untouched
    else:
        assert may_commit
    orphans = [n for n in os.listdir(root) if n.startswith(PENDING_PREFIX)]
    loaded, after = restart(root)
    assert loaded == (GEN2 if survivor["committed"] else GEN1)
    assert not [n for n in after if n.startswith(PENDING_PREFIX)], f"orphans left: {orphans}"
    if not survivor["committed"]:
        assert GEN2 not in after  # never published, never trusted


COMMIT_POINTS = ["commit.collected", "commit.before_manifest", "commit.before_rename",
                 "commit.after_rename", "commit.before_latest"]


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_rank0_killed_at_each_commit_point(tmp_path, point: str) -> None:
    root = str(tmp_path / "root")
    ranks = killable.spawn(2, fault_jobs.save_with_a_killed_rank, root, point, 0, DEADLINE_S,
                           timeout_s=120)
    ranks.processes[0].join(120)
    assert ranks.processes[0].exitcode == -9
    ranks.kill(1)  # it would wait out the deadline plus rank 0's grace for an outcome
    ranks.join(timeout_s=30)
    loaded, after = restart(root)
    renamed = point in ("commit.after_rename", "commit.before_latest")
    # old or new, complete, never a mix: the new one exactly when the rename happened
    assert loaded == (GEN2 if renamed else GEN1)
    assert not [n for n in after if n.startswith(PENDING_PREFIX)]


# issue 41: the steps of the node-level protocol (4 ranks, nodes of 2: rank 2 leads the
# second node). (point, victim, whether generation 2 may commit)
NODE_STEPS = [
    ("node.before_forward", 2, False),  # the leader dies holding its node's reports
    ("node.after_forward", 2, True),  # its node's key is posted: rank 0 may commit
    ("commit.collected", 0, False),  # rank 0 read every node's key, claimed nothing
    ("commit.claimed", 0, False),  # rank 0 claimed the commit, published nothing
]


@pytest.mark.parametrize(("point", "victim", "may_commit"), NODE_STEPS, ids=[p[0] for p in NODE_STEPS])
def test_rank_killed_at_each_node_protocol_step(tmp_path, point: str, victim: int, may_commit: bool) -> None:
    root = str(tmp_path / "root")
    ranks = killable.spawn(4, fault_jobs.save_with_a_killed_rank, root, point, victim, DEADLINE_S, 2,
                           timeout_s=120)
    ranks.processes[victim].join(120)
    assert ranks.processes[victim].exitcode == -9
    if victim == 0:
        for rank in (1, 2, 3):  # rank 0 is gone: the job would be restarted whole
            ranks.kill(rank)
        ranks.join(timeout_s=30)
        committed = False
    else:
        outcomes = ranks.join(timeout_s=150)
        survivors = [outcomes[r].result for r in (0, 1, 3)]
        assert all(s is not None for s in survivors), [outcomes[r].exitcode for r in (0, 1, 3)]
        # one verdict: every survivor recorded the same outcome
        assert len({s["committed"] for s in survivors}) == 1, survivors
        committed = survivors[0]["committed"]
        assert committed == may_commit or not committed, survivors
        assert all(s["held_s"] < DEADLINE_S + 30.0 for s in survivors), survivors
    loaded, after = restart(root)
    assert loaded == (GEN2 if committed else GEN1)
    assert not [n for n in after if n.startswith(PENDING_PREFIX)]
    if not committed:
        assert GEN2 not in after


@pytest.mark.parametrize("claim_first", [False, True], ids=["abandoned-first", "claimed-first"])
def test_a_publish_outlasting_the_deadline_has_one_verdict(tmp_path, claim_first: bool) -> None:
    """Issue 41: a leader that stops waiting for rank 0 cannot record as failed what rank 0
    then commits: whoever claims the outcome first decides it for every rank."""
    root = str(tmp_path / "root")
    ranks = run_ranks(2, fault_jobs.publish_outlasting_the_deadline, root, str(tmp_path / "faults"),
                      claim_first, timeout_s=120)
    assert [r["committed"] for r in ranks] == [claim_first, claim_first], ranks
    assert read_latest_name(open_tier(root).store) == (GEN2 if claim_first else GEN1)
    assert (GEN2 in os.listdir(root)) == claim_first
