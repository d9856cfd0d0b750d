"""Rehearsal: a generation loaded into fresh objects, component by component, and retention
that waits for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.cli.app import main as cli
from dist_ckpt.restore import rehearse as rehearsal
from dist_ckpt.restore.rehearse import RehearsalFailed
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.testing import run_ranks
from tests.helpers import launchlib, workers
from tests.helpers.local_jobs import make_state, step, two_generations


def one_step(state: TrainState) -> float:
    loss = state.model(torch.ones(2, 8)).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def test_rehearsal_of_a_good_generation_is_recorded(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    results = []
    for _ in range(2):
        with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
            results.append(mgr.rehearse(one_step))
    first, second = results
    assert first.generation == "gen-000000000002" and first.loss is not None
    assert (first.loss, first.digest) == (second.loss, second.digest)  # deterministic
    record = json.load(open(tmp_path / "rehearsals.json"))["gen-000000000002"]
    assert record["passed"] and record["digest"] == first.digest


def wider_state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 5)  # one more output than the saved Linear(8, 4)
    return TrainState(model, torch.optim.Adam(model.parameters(), lr=0.1), contract={"config": "v1"})


def test_shape_mismatch_names_the_model(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    with CheckpointManager(CheckpointConfig(root=root), wider_state()) as mgr:
        with pytest.raises(RehearsalFailed) as failure:
            mgr.rehearse(one_step)
    assert failure.value.component == "model" and "model.bias has shape (4,)" in failure.value.reason
    assert json.load(open(tmp_path / "rehearsals.json"))["gen-000000000002"]["component"] == "model"


def test_missing_optimizer_state_names_the_optimizer(tmp_path) -> None:
    root = str(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with CheckpointManager(CheckpointConfig(root=root),
                           TrainState(model, None, contract={"config": "v1"})) as mgr:
        mgr.save(1)  # weights only: no optimizer state in the generation
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        with pytest.raises(RehearsalFailed) as failure:
            mgr.rehearse()
    assert failure.value.component == "optimizer"


def test_rng_schema_change_names_rng(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    state = make_state()
    state.numpy_generators["augment"] = __import__("numpy").random.default_rng(0)
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        with pytest.raises(RehearsalFailed) as failure:
            mgr.rehearse()
    assert failure.value.component == "rng" and "augment" in failure.value.reason


def test_retention_waits_for_a_rehearsal(tmp_path) -> None:
    root = str(tmp_path)
    state = make_state()
    config = CheckpointConfig(root=root, keep_last=1, require_rehearsal=True)
    with CheckpointManager(config, state) as mgr:
        for update in (1, 2, 3):
            step(state)
            mgr.save(update)
    assert sorted(n for n in os.listdir(root) if n.startswith("gen-")) == [
        "gen-000000000001", "gen-000000000002", "gen-000000000003"]
    with CheckpointManager(config, make_state()) as mgr:
        mgr.rehearse(one_step)
        state = mgr.state
        step(state)
        mgr.save(4)
    # gen 3 passed, but gen 4 is now the newest and has not: everything stays until it does
    assert len([n for n in os.listdir(root) if n.startswith("gen-")]) == 4
    with CheckpointManager(config, make_state()) as mgr:
        mgr.rehearse(one_step)
        step(mgr.state)
        mgr.save(5)
    with CheckpointManager(CheckpointConfig(root=root, keep_last=1), make_state()) as mgr:
        step(mgr.state)
        mgr.save(6)  # without the requirement retention prunes as usual
    assert sorted(n for n in os.listdir(root) if n.startswith("gen-")) == ["gen-000000000006"]


def rehearse_sharded(rank: int, world: int, root: str) -> tuple[str, float | None, str | None]:
    job = workers.build("fsdp", rank, world, seed=42)
    with CheckpointManager(CheckpointConfig(root=root), job.state) as mgr:
        result = mgr.rehearse(lambda _state: (workers.train_step(job), job.losses[-1])[1])
    return result.generation, result.loss, result.digest


@pytest.mark.processes
def test_rehearsal_of_an_fsdp_generation_on_two_ranks(tmp_path) -> None:
    root = str(tmp_path)
    run_ranks(2, workers.save_for_reshard, "fsdp", root, 3)
    outcomes = run_ranks(2, rehearse_sharded, root)
    assert outcomes[0][0] == "gen-000000000003" and outcomes[0][2] == outcomes[1][2]
    assert outcomes[0][1] is not None


@pytest.mark.launcher  # torchrun, then the rehearsal's own torchrun
def test_cli_rehearses_with_the_jobs_own_script(tmp_path, capsys) -> None:
    root = str(tmp_path / "root")
    env = dict(launchlib.env(), DIST_CKPT_ROOT=root)
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
             launchlib.EXAMPLE, "--updates", "8", "--save-every", "2", "--stop-at", "4"]
    subprocess.run(train, env=env, check=True, capture_output=True, timeout=240)
    args = ["rehearse", root, "--script", launchlib.EXAMPLE, "--json", "--script-args", "--updates 8"]
    assert cli(args) == 0
    outcome = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outcome["generation"] == "gen-000000000004" and outcome["passed"]
    assert outcome["updates"] == 1 and len(outcome["digest"]) == 64
    assert sorted(n for n in os.listdir(root) if n.startswith("gen-")) == [
        "gen-000000000002", "gen-000000000004"]  # a rehearsal writes no generation
    assert not os.path.exists(os.path.join(root, "DONE.json"))
    assert cli(["rehearse", root, "gen-000000000002", "--script", launchlib.EXAMPLE,
                "--script-args", "--width 48"]) == 1
    assert "FAILED in contract" in capsys.readouterr().out


# ---- issue 40 item 10: a rehearsal in which no update ran fails, in every path ---------------
def recorded(root: str, generation: str = "gen-000000000002") -> dict:
    return json.load(open(os.path.join(root, "rehearsals.json")))[generation]


def test_rehearse_without_a_step_fails_in_update_and_unlocks_no_retention(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    config = CheckpointConfig(root=root, keep_last=1, require_rehearsal=True)
    with CheckpointManager(config, make_state()) as mgr:
        with pytest.raises(RehearsalFailed) as failure:
            mgr.rehearse()
    assert failure.value.component == "update" and "no update ran" in failure.value.reason
    assert not recorded(root)["passed"] and not rehearsal.passed(LocalStore(root), "gen-000000000002")


def test_a_record_that_passed_without_a_digest_is_no_pass(tmp_path) -> None:
    # what an earlier version recorded for a rehearsal whose script never trained
    (tmp_path / "rehearsals.json").write_text(json.dumps(
        {"gen-000000000002": {"passed": True, "loss": None, "digest": None}}))
    assert not rehearsal.passed(LocalStore(str(tmp_path)), "gen-000000000002")
    (tmp_path / "rehearsals.json").write_text(json.dumps(
        {"gen-000000000002": {"passed": True, "loss": 0.5, "digest": "ab" * 32, "updates": 1}}))
    assert rehearsal.passed(LocalStore(str(tmp_path)), "gen-000000000002")


def test_a_script_rehearsal_passes_only_once_it_trained(tmp_path, monkeypatch, capsys) -> None:
    """The script path in one process: restore() in rehearsal mode, then the script's next
    save (the CLI's torchrun run of it: test_cli_rehearses_with_the_jobs_own_script)."""
    import argparse

    from dist_ckpt.cli.rehearse import report

    root = str(tmp_path)
    two_generations(root)
    monkeypatch.setenv(rehearsal.REHEARSE_ENV, "newest")
    config = CheckpointConfig(root=root, keep_last=1, require_rehearsal=True)
    # a script that restores and ends before its next save
    with CheckpointManager(config, make_state()) as mgr:
        assert mgr.restore().next_update == 2
    assert not recorded(root)["passed"] and recorded(root)["component"] == "update"
    assert report(argparse.Namespace(json=False), 0, {"gen-000000000002": recorded(root)}) == 1
    assert "FAILED in update: no update ran" in capsys.readouterr().out
    # a script that saves at the generation's own update: nothing trained, exit 1
    with CheckpointManager(config, make_state()) as mgr:
        mgr.restore()
        with pytest.raises(SystemExit) as ended:
            mgr.save(2)
    assert ended.value.code == 1 and not recorded(root)["passed"] and recorded(root)["updates"] == 0
    # one update, then the save: the pass, with the digest after it
    with CheckpointManager(config, make_state()) as mgr:
        mgr.restore()
        step(mgr.state)
        with pytest.raises(SystemExit) as ended:
            mgr.save(3)
    assert ended.value.code == 0 and recorded(root)["passed"] and recorded(root)["updates"] == 1
    assert rehearsal.passed(LocalStore(root), "gen-000000000002")
    assert sorted(n for n in os.listdir(root) if n.startswith("gen-")) == [
        "gen-000000000001", "gen-000000000002"]  # a rehearsal writes no generation


def test_a_failure_in_another_component_is_not_reported_as_no_update(capsys) -> None:
    import argparse

    from dist_ckpt.cli.rehearse import report

    failed = {"passed": False, "component": "model", "reason": "model.bias has shape (4,)"}
    assert report(argparse.Namespace(json=True), 1, {"gen-000000000002": failed}) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["component"] == "model" and "problem" not in shown
    untrained = {"passed": True, "loss": None, "digest": None}  # an earlier version's record
    assert report(argparse.Namespace(json=True), 0, {"gen-000000000002": untrained}) == 1
    assert json.loads(capsys.readouterr().out)["problem"] == "no update ran"
