"""Asynchronous save: owned staging, deadlines, clean failures, the in-flight bound."""

from __future__ import annotations

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.protocol.comm import PendingGather
from dist_ckpt.testing import run_ranks
from tests.helpers import async_workers

DEADLINE = async_workers.DEADLINE_S


def test_plan_cache_is_invalidated_when_the_layout_changes(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(model, optimizer)) as mgr:
        mgr.save(1)
        mgr.save(2)
        assert mgr.plans.planning_rounds == 1
        model.append(torch.nn.Linear(4, 2))
        mgr.save(3)
        assert mgr.plans.planning_rounds == 2
        mgr.save(4)
        assert mgr.plans.planning_rounds == 2
    restored = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    state = TrainState(restored, torch.optim.SGD(restored[0].parameters(), lr=0.1))
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), state) as mgr:
        assert mgr.restore().generation == "gen-000000000004"
    assert torch.equal(restored[1].weight, model[1].weight)


@pytest.mark.processes
def test_in_flight_bound_and_staging_reuse(tmp_path) -> None:
    ranks = run_ranks(2, async_workers.in_flight_bound, str(tmp_path), timeout_s=180)
    for result in ranks:
        block, skip, two = result[("block", 1)], result[("skip", 1)], result[("block", 2)]
        # every first save returned while its writer was held (blocked fault point)
        assert block["first_in_flight"] and skip["first_in_flight"] and two["first_in_flight"]
        # block: the second save() parked in the in-flight wait until the first finished
        assert block["parked"] and block["first_done_at_second"]
        assert not block["second_skipped"] and block["committed"] == ["gen-000000000001",
                                                                      "gen-000000000002"]
        # skip, and two slots: the second save() returned while the first was still held
        assert skip["second_skipped"] and skip["skipped"] == 1 and not skip["first_done_at_second"]
        assert skip["committed"] == ["gen-000000000001"]
        assert not two["second_skipped"] and not two["first_done_at_second"]
        # staging holds exactly K copies of the state, allocated once per buffer
        assert block["peak"] == block["state_bytes"]
        assert skip["peak"] == skip["state_bytes"]
        assert two["peak"] == 2 * two["state_bytes"]


@pytest.mark.processes
def test_store_keys_of_finished_saves_are_deleted(tmp_path) -> None:
    ranks = run_ranks(2, async_workers.store_keys_after_saves, str(tmp_path))
    # rank 0 deletes an outcome (and its acknowledgement counter) once rank 1 read it; the
    # newest may still wait for its acknowledgement when rank 0 reaped its job
    assert ranks[0]["present"][:3] == [False, False, False]
    assert ranks[0]["acks"][:3] == [False, False, False]


@pytest.mark.processes
def test_close_leaves_no_threads_buffers_or_group(tmp_path) -> None:
    ranks = run_ranks(2, async_workers.close_leaves_no_threads, str(tmp_path), timeout_s=180)
    for result in ranks:
        before, plain = result["before"], result["plain"]
        assert result["during_gloo"] > before["gloo"]  # the checkpoint group's workers
        # every thread the manager started is joined and its gloo group freed
        assert plain["python"] == before["python"] and plain["gloo"] == before["gloo"]
        assert plain["staging"] == 0 and plain["jobs"] == 0 and plain["group_released"]
        # a save outliving close_timeout_s: close raises, still frees the group, lists the save
        assert "still in flight" in result["late_raised"]
        assert result["late_still_listed"] == ["gen-000000000001"]
        assert result["late_gloo"] == before["gloo"]


@pytest.mark.processes
def test_close_after_the_default_group_was_destroyed(tmp_path) -> None:
    [result] = run_ranks(1, async_workers.close_after_default_group_destroyed, str(tmp_path))
    assert result["raised"] is None and result["group_released"]
    assert result["gloo"][0] == result["gloo"][1]  # the checkpoint group's workers joined
    assert result["committed"] == ["gen-000000000001"]


@pytest.mark.processes
def test_the_staging_copy_runs_while_the_agreement_waits_for_peers(tmp_path) -> None:
    ranks = run_ranks(2, async_workers.copy_before_peers_agree, str(tmp_path), timeout_s=180)
    # rank 1 entered saves 1 and 2 only after rank 0 had copied: no deadlock, both committed
    assert ranks[0]["committed"] == ["gen-000000000001", "gen-000000000002", "gen-000000000003"]
    # save 4 was skipped on both ranks (rank 1 busy); rank 0 had copied and dropped the copy
    assert ranks[0]["skipped"] and ranks[1]["skipped"]
    assert ranks[0]["copied"] == 4 and ranks[1]["copied"] == 3
    assert ranks[0]["in_use_after_skip"] == 1  # only save 3's slot


@pytest.mark.processes
def test_gather_frames_fall_back_when_an_object_does_not_fit() -> None:
    ranks = run_ranks(2, async_workers.gather_frames, timeout_s=60)
    for result in ranks:
        assert result["small"] == [{"rank": 0}, {"rank": 1}]
        assert result["mixed"] == [(0, 0), (1, 2 * PendingGather.FRAME_BYTES)]


def test_the_agreement_frame_is_small() -> None:
    """Issue 41: the save agreement all-gathers a fixed frame per rank; at 16k ranks a
    16 KiB frame was 256 MiB per rank for about 200 bytes of facts."""
    import pickle

    from dist_ckpt.protocol.messages import SaveFacts, SpaceFacts

    facts = SaveFacts(busy=False, errors=("gen-000000000001",), boundary=True, cached=True,
                      space=SpaceFacts(leader=0, bytes=2**40, free=2**41),
                      extras={"data": "ab" * 32}, exists=None, attempt_id="0123456789ab")
    assert PendingGather.FRAME_BYTES <= 512
    assert len(pickle.dumps(facts)) <= PendingGather.FRAME_BYTES - 8


def test_a_broken_agreement_fails_the_save_with_a_commit_error(tmp_path, monkeypatch) -> None:
    """A peer dying during the agreement's all-gather surfaces as gloo's RuntimeError on the
    survivors: save() raises CommitError instead, and drops the copy it staged meanwhile."""
    from dist_ckpt import CommitError
    from dist_ckpt.protocol.comm import Comm

    class Broken:
        def wait(self) -> list:
            raise RuntimeError("Connection reset by peer")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = CheckpointConfig(root=str(tmp_path), async_save=True)
    with CheckpointManager(config, TrainState(model, optimizer)) as mgr:
        start = Comm.all_gather_start
        monkeypatch.setattr(Comm, "all_gather_start", lambda self, obj: Broken())
        with pytest.raises(CommitError, match="the save agreement failed"):
            mgr.save(1)
        assert not any(slot.in_use for slot in mgr.staging._slots)
        monkeypatch.setattr(Comm, "all_gather_start", start)
        mgr.save(2)
        mgr.wait()
        assert [g.name for g in mgr.generations() if g.state == "committed"] == ["gen-000000000002"]
