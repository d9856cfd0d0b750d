"""Lazy snapshot (``snapshot="lazy"``): ``save()`` returns before the tensor copy, the next
optimizer step waits for it, and a committed generation holds the tensors of ``save()`` time.

Ordering is shown with the blocking fault point ``stage.copy`` (the copy held until the test
releases it); ``join(timeout)`` only bounds a check that a thread is still held.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dist_ckpt import CheckpointConfig, CheckpointManager, CommitError, ConfigError, TrainState, faults
from dist_ckpt.format.manifest import DCP_DIR, generation_name
from dist_ckpt.testing import run_ranks
from tests.helpers import lazy_race, workers

pytestmark = pytest.mark.usefixtures("no_faults")
HELD_S = 0.5  # how long a held thread must stay held: a bound on the check, not an ordering


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # BatchNorm: buffers the forward pass changes, which the lazy copy must not defer
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _forward_backward(model: torch.nn.Module) -> None:
    model(torch.randn(8, 8)).square().mean().backward()


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The saved tensor state, as the manager sees it (live references)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _flat(state: dict) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def walk(value, path: str) -> None:
        if isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")

    walk(state, "")
    return out


def _load(root: str, update: int) -> dict[str, torch.Tensor]:
    """Generation ``update``'s tensors, read by plain DCP into fresh objects."""
    model, optimizer = _job(seed=99)
    _forward_backward(model)
    _step(optimizer)  # so that the optimizer has state to load into
    template = _tensors(model, optimizer)
    dcp.load(template, checkpoint_id=os.path.join(root, generation_name(update), DCP_DIR))
    return _flat(template)


def _assert_bitwise(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], what: str) -> None:
    assert saved.keys() == loaded.keys()
    for key, tensor in saved.items():
        assert tensor.dtype == loaded[key].dtype and torch.equal(tensor, loaded[key]), f"{what}: {key}"


def _lazy(root: str, **more) -> CheckpointConfig:
    return CheckpointConfig(root=root, async_save=True, snapshot="lazy", **more)


def test_no_torn_snapshot_when_the_step_follows_save_at_once(tmp_path) -> None:
    """Each save's copy is held until the next step has arrived in its pre-hook (the
    ``stage.step_waits`` point proves the step came first), then released."""
    model, optimizer = _job()
    _forward_backward(model)
    _step(optimizer)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(_lazy(str(tmp_path), max_in_flight=2), TrainState(model, optimizer)) as mgr:
        for update in range(1, 5):
            expected[update] = _flat(_tensors(model, optimizer))  # the tensors at save time
            # the forward pass changes the BatchNorm statistics in place
            lazy_race.step_behind_held_copy(update, lambda u=update: mgr.save(u),
                                            lambda: _forward_backward(model), lambda: _step(optimizer))
        mgr.wait()
    for update, saved in expected.items():
        _assert_bitwise(saved, _load(str(tmp_path), update), f"generation {update}")


def test_the_step_waits_for_the_held_copy(tmp_path) -> None:
    model, optimizer = _job()
    faults.configure({"stage.copy": {"block": "copy"}})
    with CheckpointManager(_lazy(str(tmp_path)), TrainState(model, optimizer)) as mgr:
        saved = _flat(_tensors(model, optimizer))
        job = mgr.save(1)
        faults.wait_reached("copy")  # save() returned; the copy has not started
        assert job is not None and not job.done.is_set()
        _forward_backward(model)
        stepped = threading.Event()
        stepper = threading.Thread(target=lambda: (_step(optimizer), stepped.set()))
        stepper.start()
        stepper.join(HELD_S)
        assert stepper.is_alive() and not stepped.is_set()  # held in the pre-hook
        assert torch.equal(model[0].weight, saved["/model/0.weight"])
        faults.release("copy")
        stepper.join(60)
        assert stepped.is_set() and not torch.equal(model[0].weight, saved["/model/0.weight"])
        mgr.wait()
    _assert_bitwise(saved, _load(str(tmp_path), 1), "generation 1")


def test_wait_staged_returns_once_the_copy_is_done(tmp_path) -> None:
    model, optimizer = _job()
    with CheckpointManager(_lazy(str(tmp_path)), TrainState(model, optimizer)) as mgr:
        mgr.wait_staged()  # nothing pending: at once
        mgr.save(1)
        mgr.wait()
        _forward_backward(model)
        _step(optimizer)  # the live tensors now differ from the slot's copy of update 1
        faults.configure({"stage.copy": {"block": "copy"}})
        mgr.save(2)
        faults.wait_reached("copy")
        buffers = mgr.staging._slots[0].buffers  # type: ignore[union-attr]
        weight = model[0].weight.detach()
        assert not torch.equal(buffers["/model/0.weight"], weight)
        waited = threading.Event()
        waiter = threading.Thread(target=lambda: (mgr.wait_staged(), waited.set()))
        waiter.start()
        waiter.join(HELD_S)
        assert waiter.is_alive() and not waited.is_set()
        faults.release("copy")
        waiter.join(60)
        assert waited.is_set() and torch.equal(buffers["/model/0.weight"], weight)
        model[0].weight.data.mul_(2)  # the contract kept: an in-place change after wait_staged
        mgr.wait()
    assert torch.equal(_load(str(tmp_path), 2)["/model/0.weight"], weight / 2)


@pytest.mark.processes
def test_a_failed_copy_fails_the_save_and_never_holds_the_step(tmp_path) -> None:
    model, optimizer = _job()
    # the deadline is waited out once (save 2); save 3 must commit within it beside other tests
    config = _lazy(str(tmp_path), commit_timeout_s=3.0)
    with CheckpointManager(config, TrainState(model, optimizer)) as mgr:
        faults.configure({"stage.copy": {"raise": True}})
        mgr.save(1)
        _forward_backward(model)
        _step(optimizer)
        with pytest.raises(CommitError) as failed:
            mgr.wait()
        assert "lazy staging copy failed" in failed.value.failures[0]
        # a copy held past the commit deadline: the step goes on at the deadline, the save fails
        faults.configure({"stage.copy": {"block": "late", "block_timeout_s": 60}})
        mgr.save(2)
        faults.wait_reached("late")
        _forward_backward(model)
        _step(optimizer)  # returns at the deadline, without the release
        faults.release("late")
        with pytest.raises(CommitError) as late:
            mgr.wait()
        assert "not done by the commit deadline" in late.value.failures[0]
        faults.configure(None)
        mgr.save(3)
        mgr.wait()
    assert [g.name for g in mgr.generations() if g.state == "committed"] == [generation_name(3)]


def test_config_validation(tmp_path) -> None:
    assert CheckpointConfig(root=str(tmp_path)).snapshot == "eager"
    with pytest.raises(ConfigError, match="snapshot"):
        CheckpointConfig(root=str(tmp_path), snapshot="later")
    model, optimizer = _job()
    with pytest.raises(ConfigError, match="snapshot"):  # no optimizer step to wait in
        CheckpointManager(_lazy(str(tmp_path)), TrainState(model))
    # synchronous: save() returns after the commit, lazy is the eager save; no hook
    with CheckpointManager(CheckpointConfig(root=str(tmp_path), snapshot="lazy"),
                           TrainState(model, optimizer)) as mgr:
        assert mgr.snapshots is None
        mgr.save(1)
        mgr.wait_staged()
    assert not optimizer._optimizer_step_pre_hooks
    with CheckpointManager(_lazy(str(tmp_path)), TrainState(model, optimizer)):
        assert len(optimizer._optimizer_step_pre_hooks) == 1
    assert not optimizer._optimizer_step_pre_hooks  # removed by close()


def lazy_round_trip(rank: int, world: int, root: str) -> dict:
    """FSDP2, 2 ranks: a lazy save followed at once by a step commits the save-time tensors;
    a copy that fails on rank 1 fails the generation on both ranks."""
    job = workers.build("fsdp", rank, world)
    mgr = workers.manager(job, root, async_save=True, snapshot="lazy", commit_timeout_s=30)
    workers.train_step(job)
    saved = workers.full_state(job)
    mgr.save(1)
    workers.train_step(job)  # forward, backward, step: the step waits for the copy
    mgr.wait()
    faults.configure({"stage.copy": {"rank": 1, "raise": True}})
    mgr.save(2)
    workers.train_step(job)
    try:
        mgr.wait()
        failures = None
    except CommitError as exc:
        failures = exc.failures
    faults.configure(None)
    mgr.close()
    fresh = workers.build("fsdp", rank, world, seed=5)
    again = workers.manager(fresh, root)
    generation = again.restore().generation
    again.close()
    return {"saved": saved, "loaded": workers.full_state(fresh), "generation": generation,
            "failures": failures}


@pytest.mark.processes
def test_two_rank_fsdp_lazy_round_trip(tmp_path) -> None:
    ranks = run_ranks(2, lazy_round_trip, str(tmp_path), timeout_s=120)
    assert [r["generation"] for r in ranks] == [generation_name(1)] * 2
    _assert_bitwise(ranks[0]["saved"], ranks[0]["loaded"], "restored at 2 ranks")
    for result in ranks:  # rank 1 wrote nothing; rank 0's write is not disturbed by it
        assert set(result["failures"]) == {1}, result["failures"]
        assert "lazy staging copy failed" in result["failures"][1]
