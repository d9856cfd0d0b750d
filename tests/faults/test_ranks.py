"""Slow, late, crashed and missing ranks, and a torn snapshot: an asynchronous save fails cleanly
or commits whole (2 gloo ranks; the slow rank is held at a fault point, never by a delay)."""

from __future__ import annotations

import os

import pytest
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
    # the writer is held before it reads a byte until the live tensors were mutated
    faults.configure({"write.before": {"block": "torn"}})
    try:
        with CheckpointManager(CheckpointConfig(root=str(tmp_path), async_save=True), state) as mgr:
            job = mgr.save(1)
            try:
                faults.wait_reached("torn", timeout_s=60)  # the writer has not read a byte
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(1.0)
                    for tensors in optimizer.state.values():
                        for value in tensors.values():
                            value.add_(1.0)
                assert not job.done.is_set()
            finally:
                faults.release("torn")  # the writer reads only after the mutation
    finally:
        faults.configure(None)
    assert job.committed and job.error is None
    torch.manual_seed(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    fresh_optim = torch.optim.Adam(fresh_model.parameters(), lr=0.1)
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), TrainState(fresh_model, fresh_optim)) as mgr:
        assert mgr.restore().generation == "gen-000000000001"
    for key, value in fresh_model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    loaded_optim = [v for s in fresh_optim.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(expected_optim, loaded_optim, strict=True))


@pytest.mark.processes
def test_slow_late_crashed_and_missing_ranks(tmp_path) -> None:
    root = str(tmp_path / "root")
    ranks = run_ranks(2, async_workers.slow_and_failing_ranks, root, str(tmp_path / "faults"),
                      timeout_s=180)
    fast = ranks[0]
    # rank 1's writer (or report) was held until rank 0's save() had returned: save() on the
    # fast rank returned with its job in flight, blocked only by staging + agreement
    for case in ("below", "above", "crash", "missing"):
        assert fast[f"{case}_in_flight"], case
    # above the deadline: failed cleanly on every rank, naming rank 1, nothing published
    for result in ranks:
        generation, failures, _ = result["above"]
        assert generation == "gen-000000000003" and set(failures) == {1}
        assert "did not report" in failures[1]
    # not before the deadline (a lower bound: no clock runs fast); no upper bound is needed,
    # rank 1 was held until rank 0 had seen the failure
    assert fast["above_since_save_s"] > DEADLINE - 0.5
    assert fast["latest_unchanged"]
    assert fast["entries_after_above"] == ["gen-000000000001", "gen-000000000002", "latest.json"]
    # a crashed writer fails the generation as soon as it reports: its error (not "did not
    # report") is the verdict, sooner than the deadline-bound failure measured above
    for result in ranks:
        generation, failures, seconds = result["crash"]
        assert generation == "gen-000000000005" and "FaultInjected" in failures[1]
        assert seconds < result["above"][2]
    # a missing report: the failure surfaces at the next save() on every rank, which does not save
    for result in ranks:
        generation, failures = result["next_save_raised"]
        assert generation == "gen-000000000006" and set(failures) == {1}
        assert result["committed"] == [f"gen-{n:012d}" for n in (8, 4, 2, 1)]
        assert result["pending"] == []
    assert sorted(os.listdir(root)) == [f"gen-{n:012d}" for n in (1, 2, 4, 8)] + ["latest.json"]
    # the layout never changed: one global planning round for all the saves
    assert [r["planning_rounds"] for r in ranks] == [1, 1]
