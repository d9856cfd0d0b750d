"""Moving a rejected generation aside on an ``s3://`` root (``dist_ckpt.tiers.rejected_store``):
cut short at each step, it loses nothing committed and the update still saves; it never
deletes a manifest saved again meanwhile; retention keeps what it marked, the CLI finishes it."""

from __future__ import annotations

import hashlib
import json

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, ValidationError, faults
from dist_ckpt.cli.app import main as cli
from dist_ckpt.format.inventory import inspect_generation
from dist_ckpt.format.manifest import MANIFEST_NAME, REASON_NAME, REJECTED_DIR, REJECTED_MARKER_PREFIX
from dist_ckpt.format.validate import Problem, validate
from dist_ckpt.lifecycle.retention import list_removals
from dist_ckpt.storage.objectstore import ObjectStore
from dist_ckpt.tiers import open_tier
from dist_ckpt.tiers.rejected_store import mark_and_move
from tests.helpers.local_jobs import make_state, step
from tests.helpers.matrix import record
from tests.helpers.roots import GEN1, GEN2, TwoGenRoot, make_two_gen_root

SHARD = "dcp/__0_0.distcp"
STEPS = ["quarantine.marked", "quarantine.copied", "quarantine.unlisted", "quarantine.cleaned"]


@pytest.fixture
def s3_gens(s3_endpoint: str, no_faults) -> TwoGenRoot:
    """gen-1 and gen-2 on an s3:// root, gen-2's shard truncated (restore rejects it)."""
    root = make_two_gen_root("s3", "")
    root.damage(GEN2, SHARD, "truncate")
    return root


def sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


@pytest.mark.parametrize("point", STEPS)
def test_move_cut_short_at_each_step(s3_gens: TwoGenRoot, point: str) -> None:
    store = s3_gens.store
    rejected_raw = store.read_bytes(f"{GEN2}/{MANIFEST_NAME}")
    faults.configure({point: {"raise": True}})
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_gens.url), state) as mgr:
        result = mgr.restore()  # the move fails at the point; restore goes on
        assert (result.generation, [p.generation for p in result.rejected]) == (GEN1, [GEN2])
        faults.configure(None)
        # whatever is left of the move, the rejected manifest is never taken for committed
        assert inspect_generation(store, GEN2, digests=False).state != "committed"
        step(state)
        mgr.save(2)  # the update the rejected generation held: saves (finishing the move)
    saved = validate(store, GEN2, digests=True)
    assert saved.next_update == 2 and sha(store.read_bytes(f"{GEN2}/{MANIFEST_NAME}")) != sha(rejected_raw)
    validate(store, GEN1, digests=True)  # nothing committed was lost
    [entry] = s3_gens.rejected_entries()  # one entry, however often the move was resumed
    assert store.read_bytes(f"{REJECTED_DIR}/{entry}/{MANIFEST_NAME}") == rejected_raw
    assert SHARD.split("/")[-1] in store.read_bytes(f"{REJECTED_DIR}/{entry}/{REASON_NAME}").decode()
    record("rejected generation blocks its update",
           observed=f"move aside cut short at {point}: {GEN1} intact, {GEN2} saved again",
           root="s3", point=point)


def test_move_never_deletes_a_manifest_saved_again(s3_gens: TwoGenRoot) -> None:
    """A mover held between its copy and its delete while another mover finishes and the job
    saves the update again: the late delete is refused by the entity tag, the new generation
    stays committed, and the late mover removes only the rejected attempt's objects."""
    late = ObjectStore(s3_gens.url)
    problem = Problem(GEN2, "truncated shard", SHARD)
    resaved: list[bytes] = []
    delete = late.remove_if_tagged

    def another_mover_and_a_save_first(rel: str, tag: str | None) -> bool:
        assert mark_and_move(ObjectStore(s3_gens.url), problem) is not None
        state = make_state()
        with CheckpointManager(CheckpointConfig(root=s3_gens.url), state) as mgr:
            step(state)
            mgr.save(2)
        resaved.append(late.read_bytes(f"{GEN2}/{MANIFEST_NAME}"))
        return delete(rel, tag)

    late.remove_if_tagged = another_mover_and_a_save_first  # type: ignore[method-assign]
    assert mark_and_move(late, problem) is not None
    assert late.read_bytes(f"{GEN2}/{MANIFEST_NAME}") == resaved[0]
    validate(late, GEN2, digests=True)
    assert not [n for n in late.listdir(GEN2) if n.startswith(REJECTED_MARKER_PREFIX)]
    assert [n[:16] for n in s3_gens.rejected_entries()] == [GEN2]
    record("rejected generation blocks its update",
           observed="a late mover's delete refused by the entity tag: the save of the same "
                    "update kept", root="s3")


def test_marked_generation_is_kept_by_retention_and_finished_by_the_cli(
        s3_gens: TwoGenRoot, capsys: pytest.CaptureFixture[str]) -> None:
    """A move cut short after its marker, of a generation older than the newest committed (no
    restore meets it again): retention does not take it for debris, and ``dist-ckpt
    quarantine`` finishes the move into the entry the marker names."""
    store = s3_gens.store
    faults.configure({"quarantine.marked": {"raise": True}})
    with pytest.raises(faults.FaultInjected):
        mark_and_move(store, Problem(GEN1, "operator"))
    faults.configure(None)
    tier = open_tier(s3_gens.url)
    assert GEN1 not in list_removals(tier, keep_last=None).incomplete
    assert cli(["quarantine", s3_gens.url, GEN1]) == 0
    [entry] = s3_gens.rejected_entries()
    assert f"moved {GEN1} aside to {s3_gens.url}/{REJECTED_DIR}/{entry}" in capsys.readouterr().out
    assert store.listdir(GEN1) == [] and "operator" in store.read_bytes(
        f"{REJECTED_DIR}/{entry}/{REASON_NAME}").decode()


@pytest.mark.parametrize("fields", [{"data_dir": "../gen-000000000001"}, {"entry": "gen-000000000001-x"},
                                    {"manifest_sha256": "0" * 64}])
def test_a_marker_not_ours_is_refused(s3_gens: TwoGenRoot, fields: dict) -> None:
    """A hostile marker in place of ours: the move refuses it (ValidationError naming it) and
    deletes nothing; the rejected manifest still counts as rejected."""
    store = s3_gens.store
    raw = store.read_bytes(f"{GEN2}/{MANIFEST_NAME}")
    name = f"{REJECTED_MARKER_PREFIX}{sha(raw)}.json"
    marker = {"generation": GEN2, "manifest_sha256": sha(raw), "entry": f"{GEN2}-20260101T000000Z-abcdef",
              "data_dir": "attempt-x", "reason": "r", "time": 0.0, **fields}
    store.put_bytes(f"{GEN2}/{name}", json.dumps(marker).encode())
    before = store.find("")
    with pytest.raises(ValidationError) as caught:
        mark_and_move(store, Problem(GEN2, "truncated shard", SHARD))
    assert caught.value.path == name and store.find("") == before
    assert inspect_generation(store, GEN2, digests=False).path == name
