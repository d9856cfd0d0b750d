"""Faults on an object-store root: two writers of one generation, and an object swapped
between validation and load (a corrupt object: ``test_local_faults``, on both kinds of root)."""

from __future__ import annotations

import threading

import pytest
import torch

import dist_ckpt.restore.resume as resume_mod
from dist_ckpt import CheckpointConfig, CheckpointManager, CommitError, faults
from dist_ckpt.cli.app import main as cli
from dist_ckpt.format.validate import read_manifest
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers.local_jobs import make_state, step, two_generations
from tests.helpers.matrix import record, timed


def test_two_writers_one_generation(s3_root: str) -> None:
    """Two jobs race to commit gen 5: both pass the existence check and upload, then the
    conditional create of the manifest lets exactly one win."""
    states = [make_state(), make_state()]
    step(states[1])
    outcomes: dict[int, str] = {}
    # both writers are held before the manifest until both got there: both passed the
    # existence check and uploaded their files before either can commit
    faults.configure({"commit.before_manifest": {"block": "both_uploaded"}})

    def writer(index: int) -> None:
        with CheckpointManager(CheckpointConfig(root=s3_root), states[index]) as mgr:
            try:
                mgr.save(5)
                outcomes[index] = "committed"
            except CommitError as exc:
                outcomes[index] = str(exc)

    try:
        threads = [threading.Thread(target=writer, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        try:
            faults.wait_reached("both_uploaded", count=2, timeout_s=60)
            assert outcomes == {}
        finally:
            faults.release("both_uploaded")
        for thread in threads:
            thread.join(60)
    finally:
        faults.configure(None)
    assert sorted(outcomes) == [0, 1]
    winners = [i for i, o in outcomes.items() if o == "committed"]
    assert len(winners) == 1, outcomes
    loser = outcomes[1 - winners[0]]
    assert "GenerationExists" in loser and "another writer committed" in loser
    assert cli(["verify", s3_root, "gen-000000000005"]) == 0
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root), fresh) as mgr:
        assert mgr.restore().generation == "gen-000000000005"
    for key, value in fresh.model.state_dict().items():  # the winner's bytes, not a mix
        assert torch.equal(value, states[winners[0]].model.state_dict()[key])
    backend = ObjectStore(s3_root)
    attempts = [c for c in backend.listdir("gen-000000000005") if c.startswith("attempt-")]
    assert attempts == [read_manifest(backend, "gen-000000000005").data_dir]  # loser's removed


@pytest.mark.parametrize("target", ["dcp/.metadata", "dcp/__0_0.distcp", "state/train_state.json"])
def test_object_swapped_after_validation_is_never_deserialised(
        s3_root: str, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer of the bucket swaps an object of the chosen generation between its validation
    and its load: the swapped bytes are never deserialised, the generation is rejected naming
    the object, and the same restore() call loads the previous one."""
    two_generations(s3_root)
    backend = ObjectStore(s3_root)
    original = resume_mod.select_generation
    swapped: list[str] = []

    def select_then_swap(*args, **kwargs):
        chosen = original(*args, **kwargs)
        if chosen[0] == "gen-000000000002" and not swapped:
            key = backend._key(f"gen-000000000002/{chosen[1].location(target)}")
            data = bytearray(backend.fs.cat_file(key))
            data[len(data) // 2] ^= 0xFF  # same size, different bytes: a writer racing the restore
            backend.fs.pipe_file(key, bytes(data))
            swapped.append(key)
        return chosen

    monkeypatch.setattr(resume_mod, "select_generation", select_then_swap)
    with CheckpointManager(CheckpointConfig(root=s3_root), make_state()) as mgr:
        result, recover_s = timed(mgr.restore)
    assert swapped and result.generation == "gen-000000000001"
    problem = next(p for p in result.rejected if p.generation == "gen-000000000002")
    assert "changed after validation" in problem.reason
    assert target.rsplit("/", 1)[-1] in problem.reason
    record("object swapped after validation", observed=f"{target} swapped: rejected ({problem.path}); "
           "restored gen-000000000001 in the same call", recover_s=round(recover_s, 3), target=target)
