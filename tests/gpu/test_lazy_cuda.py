"""Lazy snapshot of CUDA tensors: the deferred copy runs on a side stream ordered by events
(after the work queued before ``save()``, before the next optimizer step's kernels), with no
device-wide synchronisation, and commits the tensors of ``save()`` time bitwise.

Ordering is shown as in ``tests/test_lazy_snapshot.py``: the copy is held at the blocking fault
point ``stage.copy`` until the next step has arrived in its pre-hook (``stage.step_waits``).
Skipped where no CUDA device exists (this is the only place skips are allowed).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.format.manifest import DCP_DIR, generation_name
from tests.helpers import lazy_race

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("no_faults")]


def _job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # 64 MiB of weights: a device copy long enough for a missing stream wait to tear it;
    # BatchNorm: buffers the forward pass changes (copied in save(), queued on the stream)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.BatchNorm1d(4096)).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=0.01)  # its "step" tensors stay on CPU


def _forward_backward(model: torch.nn.Module) -> None:
    model(torch.randn(16, 4096, device="cuda")).square().mean().backward()


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    _forward_backward(model)
    _step(optimizer)


def _flat(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    out: dict[str, torch.Tensor] = {}
    for name, value in model_sd.items():
        out[f"model/{name}"] = value.detach().cpu().clone()
    for name, per_param in optim_sd["state"].items():
        for key, value in per_param.items():
            out[f"optim/{name}/{key}"] = value.detach().cpu().clone()
    return out


def _load(root: str, update: int) -> dict[str, torch.Tensor]:
    model, optimizer = _job(seed=99)
    _train(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    template = {"model": model_sd, "optim": optim_sd}
    dcp.load(template, checkpoint_id=os.path.join(root, generation_name(update), DCP_DIR))
    return _flat(model, optimizer)


def test_lazy_cuda_snapshot_is_exact_and_never_synchronises_the_device(tmp_path, monkeypatch) -> None:
    """Each save's copy is held until the next step has arrived in its pre-hook (the
    ``stage.step_waits`` point proves the step came first), then released: the step's kernels
    are queued on its stream right behind the side stream's copy, and only its done event
    keeps them from tearing it."""
    model, optimizer = _job()
    _train(model, optimizer)
    synchronize_calls: list[object] = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: (synchronize_calls.append(a), real_synchronize(*a, **k))[1])
    expected = {}
    config = CheckpointConfig(root=str(tmp_path), async_save=True, snapshot="lazy", max_in_flight=2)
    with CheckpointManager(config, TrainState(model, optimizer)) as mgr:
        for update in range(1, 4):
            expected[update] = _flat(model, optimizer)  # .cpu(): synchronises the current stream only
            # the forward pass changes the BatchNorm statistics in place (copied in save())
            lazy_race.step_behind_held_copy(update, lambda u=update: mgr.save(u),
                                            lambda: _forward_backward(model), lambda: _step(optimizer))
        streams = dict(mgr.snapshots._streams)  # type: ignore[union-attr]
        mgr.wait_staged()
        mgr.wait()
    assert synchronize_calls == []
    device = torch.device("cuda", torch.cuda.current_device())
    assert set(streams) == {device} and streams[device] != torch.cuda.default_stream(device)
    for update, saved in expected.items():
        loaded = _load(str(tmp_path), update)
        assert saved.keys() == loaded.keys()
        for key, tensor in saved.items():
            assert torch.equal(tensor, loaded[key]), f"generation {update}: {key}"


def test_wait_staged_leaves_the_cuda_copy_complete(tmp_path) -> None:
    model, optimizer = _job()
    _train(model, optimizer)
    config = CheckpointConfig(root=str(tmp_path), async_save=True, snapshot="lazy")
    with CheckpointManager(config, TrainState(model, optimizer)) as mgr:
        mgr.save(1)
        mgr.wait_staged()
        weight = model[0].weight.detach().cpu()
        model[0].weight.data.mul_(3)  # the contract kept: changed in place after wait_staged
        buffers = mgr.staging._slots[0].buffers  # type: ignore[union-attr]
        assert buffers["/model/0.weight"].is_pinned()
        assert torch.equal(buffers["/model/0.weight"], weight)
        mgr.wait()
    assert torch.equal(_load(str(tmp_path), 1)["model/0.weight"], weight)
