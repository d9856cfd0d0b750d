"""Asynchronous save: owned staging, deadlines, clean failures, the in-flight bound."""

from __future__ import annotations

import os

import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState, faults
from dist_ckpt.testing import run_ranks
from tests.helpers import async_workers

DEADLINE = async_workers.DEADLINE_S


def test_torn_snapshot_is_impossible(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 32)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = TrainState(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = [v.clone() for s in optimizer.state.values() for v in s.values()]
    faults.configure({"write.before": {"delay_s": 0.5}})  # the writer reads after the mutation
    try:
        with CheckpointManager(CheckpointConfig(root=str(tmp_path), async_save=True), state) as mgr:
            mgr.save(1)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)
                for tensors in optimizer.state.values():
                    for value in tensors.values():
                        value.add_(1.0)
    finally:
        faults.configure(None)
    torch.manual_seed(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    fresh_optim = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(fresh_model, fresh_optim)) as mgr:
        assert mgr.restore().generation == "gen-000000000001"
    for key, value in fresh_model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    loaded_optim = [v for s in fresh_optim.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(expected_optim, loaded_optim, strict=True))


def test_slow_late_crashed_and_missing_ranks(tmp_path) -> None:
    root = str(tmp_path)
    ranks = run_ranks(2, async_workers.slow_and_failing_ranks, root, timeout_s=180)
    fast = ranks[0]
    # below the deadline: committed; the fast rank was blocked only by staging + agreement
    assert fast["below_blocked_s"] < 1.0
    # above the deadline: failed cleanly on every rank, naming rank 1, nothing published
    for result in ranks:
        generation, failures, _ = result["above"]
        assert generation == "gen-000000000003" and set(failures) == {1}
        assert "did not report" in failures[1]
    assert fast["above_blocked_s"] < 1.0
    assert DEADLINE - 0.5 < fast["above"][2] < DEADLINE + 3.0
    assert fast["latest_unchanged"]
    assert fast["entries_after_above"] == ["gen-000000000001", "gen-000000000002", "latest.json"]
    # a crashed writer fails the generation as soon as it reports, well before the deadline
    for result in ranks:
        generation, failures, seconds = result["crash"]
        assert generation == "gen-000000000005" and "FaultInjected" in failures[1]
        assert seconds < DEADLINE
    assert fast["crash_blocked_s"] < 1.0
    # a missing report: the failure surfaces at the next save() on every rank, which does not save
    assert fast["missing_blocked_s"] < 1.0
    for result in ranks:
        generation, failures = result["next_save_raised"]
        assert generation == "gen-000000000006" and set(failures) == {1}
        assert result["committed"] == [f"gen-{n:012d}" for n in (8, 4, 2, 1)]
        assert result["pending"] == []
    assert sorted(os.listdir(root)) == [f"gen-{n:012d}" for n in (1, 2, 4, 8)] + ["latest.json"]
    # the layout never changed: one global planning round for all the saves
    assert [r["planning_rounds"] for r in ranks] == [1, 1]


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


def test_in_flight_bound_and_staging_reuse(tmp_path) -> None:
    ranks = run_ranks(2, async_workers.in_flight_bound, str(tmp_path), timeout_s=180)
    for result in ranks:
        block, skip, two = result[("block", 1)], result[("skip", 1)], result[("block", 2)]
        assert block["first_s"] < 1.0 and block["second_s"] > 1.0  # waited for the slow writer
        assert not block["second_skipped"] and block["committed"] == ["gen-000000000001",
                                                                      "gen-000000000002"]
        assert skip["second_skipped"] and skip["skipped"] == 1 and skip["second_s"] < 1.0
        assert skip["committed"] == ["gen-000000000001"]
        assert two["second_s"] < 1.0 and not two["second_skipped"]
        # staging holds exactly K copies of the state, allocated once per buffer
        assert block["peak"] == block["state_bytes"]
        assert skip["peak"] == skip["state_bytes"]
        assert two["peak"] == 2 * two["state_bytes"]


def test_store_keys_of_finished_saves_are_deleted(tmp_path) -> None:
    ranks = run_ranks(2, async_workers.store_keys_after_saves, str(tmp_path))
    # rank 0 deletes an outcome (and its acknowledgement counter) once rank 1 read it; the
    # newest may still wait for its acknowledgement when rank 0 reaped its job
    assert ranks[0]["present"][:3] == [False, False, False]
    assert ranks[0]["acks"][:3] == [False, False, False]


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


def test_close_after_the_default_group_was_destroyed(tmp_path) -> None:
    [result] = run_ranks(1, async_workers.close_after_default_group_destroyed, str(tmp_path))
    assert result["raised"] is None and result["group_released"]
    assert result["gloo"][0] == result["gloo"][1]  # the checkpoint group's workers joined
    assert result["committed"] == ["gen-000000000001"]
