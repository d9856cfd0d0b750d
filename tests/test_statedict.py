"""StateDictReader: torch's get_state_dict with its per-model preparation kept between saves
gives what get_state_dict gives, reads changing values fresh, prepares once while the
parameters stay the same objects, and prepares again when they change."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from dist_ckpt.restart import statedict
from dist_ckpt.restart.statedict import StateDictReader


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def count_preparations(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = statedict.torch_state_dict._verify_options

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(statedict.torch_state_dict, "_verify_options", counting)
    return calls


def assert_same(ours: tuple[dict, dict], theirs: tuple[dict, dict]) -> None:
    (model_sd, optim_sd), (their_model_sd, their_optim_sd) = ours, theirs
    assert model_sd.keys() == their_model_sd.keys()
    assert all(torch.equal(model_sd[k], their_model_sd[k]) for k in model_sd)
    assert optim_sd["param_groups"] == their_optim_sd["param_groups"]
    assert optim_sd["state"].keys() == their_optim_sd["state"].keys()
    for fqn, entries in optim_sd["state"].items():
        assert entries.keys() == their_optim_sd["state"][fqn].keys()
        assert all(torch.equal(entries[k], their_optim_sd["state"][fqn][k]) for k in entries)


@pytest.mark.parametrize("private", [True, False])
def test_it_reads_what_get_state_dict_reads_after_every_step(monkeypatch, private: bool) -> None:
    monkeypatch.setattr(statedict, "_HAS_PRIVATE", private and statedict._HAS_PRIVATE)
    model, optimizer = trained()
    reader = StateDictReader(model, optimizer)
    for _ in range(3):
        ours = reader.read()
        assert_same(ours, get_state_dict(model, optimizer))
        train_step(model, optimizer)
        optimizer.param_groups[0]["lr"] *= 0.5  # what a scheduler does: read fresh every time
    assert reader.read()[1]["param_groups"][0]["lr"] == pytest.approx(0.1 / 8)


def test_it_prepares_once_while_the_parameters_stay_the_same(monkeypatch) -> None:
    model, optimizer = trained()
    reader = StateDictReader(model, optimizer)
    preparations = count_preparations(monkeypatch)
    for _ in range(3):
        reader.read()
        train_step(model, optimizer)
    assert len(preparations) == 1


def test_a_parameter_added_after_the_first_read_is_in_the_next(monkeypatch) -> None:
    model, optimizer = trained()
    reader = StateDictReader(model, optimizer)
    preparations = count_preparations(monkeypatch)
    first = reader.read()
    model.add_module("head", torch.nn.Linear(2, 3))
    optimizer.add_param_group({"params": list(model.head.parameters())})
    train_step(torch.nn.Sequential(*model), optimizer)
    second = reader.read()
    assert len(preparations) == 2  # the new parameters are other objects: prepared again
    assert "head.weight" not in first[0] and "head.weight" in second[0]
    assert "head.weight" in second[1]["state"]
    assert_same(second, get_state_dict(model, optimizer))


def test_private_pieces_with_other_signatures_fall_back_to_get_state_dict(monkeypatch) -> None:
    def other_signature(*args, **kwargs):
        raise TypeError("_verify_options() got an unexpected keyword argument 'optim_only'")

    model, optimizer = trained()
    reader = StateDictReader(model, optimizer)
    public = get_state_dict(model, optimizer)  # what the public API gives (it uses the real pieces)
    monkeypatch.setattr(statedict.torch_state_dict, "_verify_options", other_signature)
    monkeypatch.setattr(statedict, "get_state_dict", lambda *args, **kwargs: public)
    assert reader.read() is public
    assert not reader._private
    assert reader.read() is public  # and from then on, without trying the private pieces
