"""Incremental generations (issue 28): a frozen parameter is written once as a shared object
and referenced while its bytes provably did not change; anything not proven is written in
full; every generation restores by itself, at the same and at another world size."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dist_ckpt.format.manifest import INCREMENTAL_FORMAT_VERSION, OBJECTS_DIR
from dist_ckpt.save.reuse import ReuseLedger
from dist_ckpt.testing import run_ranks
from tests.helpers import finetune_jobs
from tests.helpers.finetune_jobs import Tuned
from tests.helpers.incremental_tiers import manifest, objects_of, own_bytes

GEN1, GEN2 = "gen-000000000001", "gen-000000000002"


def without_second(root: str, tmp_path) -> str:  # noqa: ANN001 - pytest's tmp_path
    """A copy of ``root`` without gen 2: gen 1 must restore by itself (objects stay)."""
    copy = str(tmp_path / "root")
    shutil.copytree(root, copy)
    shutil.rmtree(os.path.join(copy, GEN2))
    return copy


def assert_same(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == found.keys()
    for key, tensor in expected.items():
        assert torch.equal(tensor, found[key]), key


@pytest.fixture(scope="module")
def fsdp_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """Two FSDP2 generations of a job with a frozen base, on 2 ranks."""
    root = str(tmp_path_factory.mktemp("incremental") / "root")
    results = run_ranks(2, finetune_jobs.run, "fsdp", root, [1, 2])
    return root, results[0]


@pytest.mark.processes
def test_consecutive_generations_share_the_frozen_base(fsdp_root) -> None:
    root, _ = fsdp_root
    first, second = objects_of(root, GEN1), objects_of(root, GEN2)
    # base1 and base2, weight each, one shard per rank: four objects, listed by both
    assert len(first) == 4 and first == second
    assert manifest(root, GEN2)["format_version"] == INCREMENTAL_FORMAT_VERSION
    assert sorted(f"{OBJECTS_DIR}/{n}" for n in os.listdir(os.path.join(root, OBJECTS_DIR))) == sorted(first)
    frozen = sum(first.values())
    # the second generation's own bytes are the trainable state and the small state only
    assert own_bytes(root, GEN2) < frozen
    assert not any(n.startswith(".pending") for n in os.listdir(root))


@pytest.mark.processes
def test_either_generation_restores_bitwise_at_the_same_world_size(fsdp_root, tmp_path) -> None:
    root, saved = fsdp_root
    restored = run_ranks(2, finetune_jobs.restore, "fsdp", root)
    assert restored[0]["generation"] == GEN2
    assert_same(saved["full"][2], restored[0]["full"])
    # the first generation without the second: complete by itself
    restored = run_ranks(2, finetune_jobs.restore, "fsdp", without_second(root, tmp_path))
    assert restored[0]["generation"] == GEN1
    assert_same(saved["full"][1], restored[0]["full"])


@pytest.mark.processes
def test_either_generation_restores_at_another_world_size(fsdp_root, tmp_path) -> None:
    root, saved = fsdp_root
    restored = run_ranks(1, finetune_jobs.restore, "plain", root)
    assert restored[0]["generation"] == GEN2
    assert_same(saved["full"][2], restored[0]["full"])
    restored = run_ranks(1, finetune_jobs.restore, "plain", without_second(root, tmp_path))
    assert restored[0]["generation"] == GEN1
    assert_same(saved["full"][1], restored[0]["full"])


@pytest.mark.processes
def test_plain_dcp_load_reads_the_shared_objects(fsdp_root) -> None:
    root, saved = fsdp_root
    model = Tuned()
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=os.path.join(root, GEN2, "dcp"), no_dist=True)
    for key, tensor in state["model"].items():
        assert torch.equal(tensor, saved["full"][2][f"/model/{key}"]), key


@pytest.mark.processes
@pytest.mark.parametrize("snapshot", ["eager", "lazy"])
def test_a_reused_object_is_neither_staged_nor_written_again(tmp_path, snapshot: str) -> None:
    root = str(tmp_path / "root")
    saved = run_ranks(1, finetune_jobs.run, "plain", root, [1, 2, 3],
                      {"async_save": True, "snapshot": snapshot})[0]
    frozen = 2 * finetune_jobs.WIDTH * finetune_jobs.WIDTH * 4
    staged, seen = saved["staged_bytes"], saved["inodes"]
    # the first save staged the frozen base; later ones hold no staging buffer for it
    assert staged[1] >= frozen and staged[2] < frozen and staged[3] < frozen
    # the same two files all along: a rewrite would rename a new file (another inode) in
    assert len(seen[1]) == 2 and seen[1] == seen[2] == seen[3]
    assert objects_of(root, GEN1) == objects_of(root, "gen-000000000003")


@pytest.mark.processes
@pytest.mark.parametrize("change", ["inplace", "replace", "pointer"])
def test_a_changed_frozen_tensor_is_written_in_full(tmp_path, change: str) -> None:
    root = str(tmp_path / "root")
    saved = run_ranks(1, finetune_jobs.run, "plain", root, [1, 2], {"change": change, "change_after": 2})[0]
    first, second = objects_of(root, GEN1), objects_of(root, GEN2)
    assert len(first) == len(second) == 2
    # base1's weight changed: a new object; base2's is shared
    assert len(set(first) & set(second)) == 1
    restored = run_ranks(1, finetune_jobs.restore, "plain", root)
    assert restored[0]["generation"] == GEN2
    assert_same(saved["full"][2], restored[0]["full"])


@pytest.mark.processes
def test_incremental_false_and_reuse_full_every(tmp_path) -> None:
    full = str(tmp_path / "full")
    run_ranks(1, finetune_jobs.run, "plain", full, [1, 2], {"incremental": False})
    assert not os.path.exists(os.path.join(full, OBJECTS_DIR))
    assert manifest(full, GEN2)["format_version"] < INCREMENTAL_FORMAT_VERSION
    # every second save rewrites its frozen tensors: the objects are renamed in anew
    every = str(tmp_path / "every")
    seen = run_ranks(1, finetune_jobs.run, "plain", every, [1, 2, 3], {"reuse_full_every": 2})[0]["inodes"]
    assert objects_of(every, GEN1) == objects_of(every, GEN2)
    assert seen[1].keys() == seen[2].keys() == seen[3].keys()
    assert seen[1] != seen[2] and seen[2] == seen[3]  # the second save wrote them anew


# ---- the ledger's proof, in one process --------------------------------------------------
def _ledger() -> tuple[Tuned, torch.optim.Optimizer, ReuseLedger]:
    torch.manual_seed(0)
    model = Tuned()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, optimizer, ReuseLedger(model, optimizer, full_every=0)


def _settled(ledger: ReuseLedger, model: Tuned, update: int) -> None:
    """Pretend a save of ``update`` wrote every candidate and committed."""
    decision = ledger.decide({"model": model.state_dict()}, "layout")
    decision.written = {fqn: {(0, 0): _record(ledger, decision, fqn)} for fqn in decision.proofs}
    ledger.settle(decision, "layout", update, committed=True)


def _record(ledger: ReuseLedger, decision, fqn: str):  # noqa: ANN001, ANN202 - test double
    from dist_ckpt.save.reuse import Record

    return Record(decision.proofs[fqn], (finetune_jobs.WIDTH, finetune_jobs.WIDTH), None, {"path": fqn})  # type: ignore[arg-type]


def test_only_frozen_parameters_over_the_small_item_size_are_candidates() -> None:
    """Tuned's small frozen biases stay out: together they are under PACK_MIN_BYTES
    (tests/test_small_tensors.py has the pack of small frozen tensors that reach it)."""
    model, _, ledger = _ledger()
    decision = ledger.decide({"model": model.state_dict()}, "layout")
    assert set(decision.proofs) == {"model.base1.weight", "model.base2.weight"}
    assert decision.reused == {}


def test_proof_holds_until_the_parameter_changes() -> None:
    model, _, ledger = _ledger()
    _settled(ledger, model, 1)
    assert set(ledger.decide({"model": model.state_dict()}, "layout").reused) == \
        {"model.base1.weight", "model.base2.weight"}
    with torch.no_grad():
        model.base1.weight.mul_(1.0)  # same values, but a write: the proof is gone
    decision = ledger.decide({"model": model.state_dict()}, "layout")
    assert set(decision.reused) == {"model.base2.weight"}
    # another layout (fingerprint) or a failed save changes nothing either way
    assert ledger.decide({"model": model.state_dict()}, "other").reused == {}
    ledger.settle(decision, "layout", 1, committed=True)  # not newer than the records: ignored
    assert set(ledger.decide({"model": model.state_dict()}, "layout").reused) == {"model.base2.weight"}


def test_a_parameter_out_of_every_param_group_is_frozen() -> None:
    torch.manual_seed(0)
    model = Tuned()
    model.base1.requires_grad_(True)  # trainable flag, but the optimizer never steps it
    optimizer = torch.optim.AdamW(list(model.adapter.parameters()) + list(model.head.parameters()))
    ledger = ReuseLedger(model, optimizer, full_every=0)
    assert set(ledger.decide({"model": model.state_dict()}, "layout").proofs) == \
        {"model.base1.weight", "model.base2.weight"}
    optimizer.add_param_group({"params": [model.base1.weight]})
    assert set(ledger.decide({"model": model.state_dict()}, "layout").proofs) == {"model.base2.weight"}


def test_rewrite_frozen_and_full_every_force_a_full_write() -> None:
    model, _, ledger = _ledger()
    _settled(ledger, model, 1)
    ledger.rewrite_frozen()
    assert ledger.decide({"model": model.state_dict()}, "layout").reused == {}
    assert ledger.decide({"model": model.state_dict()}, "layout").reused != {}
    ledger.full_every = 2
    decisions = [bool(ledger.decide({"model": model.state_dict()}, "layout").reused) for _ in range(4)]
    assert decisions.count(False) == 2


@pytest.mark.processes
def test_a_restarted_job_references_the_objects_it_loaded(tmp_path) -> None:
    root = str(tmp_path / "root")
    run_ranks(2, finetune_jobs.run, "fsdp", root, [1, 2])
    resumed = run_ranks(2, finetune_jobs.resume_and_save, "fsdp", root, [3])[0]
    assert resumed["generation"] == GEN2
    seen = resumed["inodes"]
    # loaded from these objects (verified), unchanged since: referenced, not written again
    assert len(seen[0]) == 4 and seen[3] == seen[0]
    assert objects_of(root, "gen-000000000003") == objects_of(root, GEN2)
    restored = run_ranks(2, finetune_jobs.restore, "fsdp", root)[0]
    assert restored["generation"] == "gen-000000000003"
    assert_same(resumed["full"][3], restored["full"])


@pytest.mark.processes
def test_a_job_restarted_at_another_world_size_writes_its_shards_anew(tmp_path) -> None:
    root = str(tmp_path / "root")
    run_ranks(2, finetune_jobs.run, "fsdp", root, [1])
    resumed = run_ranks(1, finetune_jobs.resume_and_save, "plain", root, [2])[0]
    # one rank now holds each whole weight: no saved chunk is its shard, so both are written
    second = objects_of(root, GEN2)
    assert len(second) == 2 and not set(second) & set(objects_of(root, GEN1))
    restored = run_ranks(1, finetune_jobs.restore, "plain", root)[0]
    assert_same(resumed["full"][2], restored["full"])


@pytest.mark.processes
def test_ddp_stages_no_frozen_tensor_another_rank_writes(tmp_path) -> None:
    root = str(tmp_path / "root")
    results = run_ranks(2, finetune_jobs.run, "ddp", root, [1, 2, 3], {"async_save": True})
    one_weight = finetune_jobs.WIDTH * finetune_jobs.WIDTH * 4
    for rank, saved in enumerate(results):
        staged = saved["staged_bytes"]
        assert staged[1] >= 2 * one_weight, rank  # no plan yet: the whole replicated base
        # DCP writes each replicated weight once, on one rank: the other stages none of it,
        # and the one that wrote it references it from then on
        assert staged[2] < one_weight and staged[3] < one_weight, (rank, staged)
    assert len(objects_of(root, GEN2)) == 2
    restored = run_ranks(2, finetune_jobs.restore, "ddp", root)[0]
    assert_same(results[0]["full"][3], restored["full"])
