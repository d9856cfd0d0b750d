"""Damaged bytes after a commit, in every kind of file, and a damaged or dangling latest
pointer: a clear error naming the file, a fallback to the older generation, never a silent
load (single process; the damaged files on a local and an s3:// root)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, ValidationError
from dist_ckpt.cli.app import main as cli
from dist_ckpt.format.manifest import LATEST_NAME, generation_name
from dist_ckpt.format.validate import validate
from tests.helpers.local_jobs import damage, make_state, two_generations
from tests.helpers.matrix import record, timed
from tests.helpers.roots import TwoGenRoot

GEN1, GEN2 = generation_name(1), generation_name(2)
TARGETS = {
    "shard": "dcp/__0_0.distcp",
    "dcp metadata": "dcp/.metadata",
    "state file": "state/train_state.json",
    "rank state file": "state/rank-00000.json",
    "manifest": "manifest.json",
}


def restore(root: str):
    with CheckpointManager(CheckpointConfig(root=root), make_state()) as mgr:
        return mgr.restore()


# every damage on a local root; on an s3:// root one flipped byte in each small file the
# manifest or DCP needs first (each s3 case runs a job against moto; a missing shard on s3:
# below, a flipped one: test_local_faults)
CASES = [pytest.param("local", target, how) for target in TARGETS for how in ("bitflip", "truncate")]
CASES += [pytest.param("s3", target, how, marks=pytest.mark.processes)
          for target, how in [("dcp metadata", "bitflip"), ("manifest", "bitflip")]]


@pytest.mark.parametrize("two_gen_root, target, how", CASES, indirect=["two_gen_root"])
def test_damaged_file_is_named_and_skipped(two_gen_root: TwoGenRoot, capsys, target: str,
                                           how: str) -> None:
    root = two_gen_root.url
    rel = TARGETS[target]
    two_gen_root.damage(GEN2, rel, how)
    store = two_gen_root.store
    started = time.perf_counter()
    with pytest.raises(ValidationError) as caught:
        validate(store, GEN2, digests=True)
    detect_s = time.perf_counter() - started
    named = caught.value.path
    if target != "manifest":
        assert named == rel
    else:  # a flipped byte in the manifest may break the JSON or a digest it lists
        assert named is not None
    assert cli(["verify", root, GEN2]) == 1
    assert (named or "") in capsys.readouterr().out
    result, recover_s = timed(lambda: restore(root))
    assert result.generation == GEN1  # the fallback, in the same call
    assert [(p.generation, p.path) for p in result.rejected] == [(GEN2, named)]
    record("corrupted bytes", observed=f"{how} in {rel}: rejected naming {named}; restored {GEN1}",
           detect_s=round(detect_s, 3), recover_s=round(recover_s, 3), target=target, how=how,
           root=two_gen_root.kind)


def test_missing_shard_after_commit(two_gen_root: TwoGenRoot, capsys) -> None:
    root = two_gen_root.url
    two_gen_root.remove(GEN2, TARGETS["shard"])
    assert cli(["verify", root, GEN2]) == 1
    assert TARGETS["shard"] in capsys.readouterr().out
    result, recover_s = timed(lambda: restore(root))
    assert result.generation == GEN1
    assert [(p.generation, p.path) for p in result.rejected] == [(GEN2, TARGETS["shard"])]
    assert "missing" in result.rejected[0].reason
    record("missing shard after commit", observed=f"verify exit 1 naming {TARGETS['shard']}; "
           f"restored {GEN1} ({two_gen_root.kind} root)", recover_s=round(recover_s, 3),
           root=two_gen_root.kind)


@pytest.mark.parametrize("how", ["bitflip", "truncate", "garbage"])
def test_damaged_latest_pointer_is_a_warning_not_a_choice(tmp_path, how: str) -> None:
    root = str(tmp_path)
    two_generations(root)
    pointer = os.path.join(root, LATEST_NAME)
    if how == "garbage":
        with open(pointer, "wb") as handle:
            handle.write(b"\xff\xfe not json")
    else:
        damage(pointer, how)
    result, recover_s = timed(lambda: restore(root))
    assert result.generation == GEN2  # the pointer is a hint: validation chooses
    assert any(LATEST_NAME in note for note in result.warnings), result.warnings
    record("corrupted bytes", observed=f"{how} in {LATEST_NAME}: warning naming it; restored {GEN2}",
           recover_s=round(recover_s, 3), target="latest pointer", how=how)


def test_latest_pointer_to_a_missing_generation(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root)
    shutil.rmtree(os.path.join(root, GEN2))
    result, recover_s = timed(lambda: restore(root))
    assert result.generation == GEN1 and not result.fresh  # never a silent fresh start
    assert any(GEN2 in note and "missing" in note for note in result.warnings), result.warnings
    record("latest pointer to a missing generation", observed=f"warning naming {GEN2}; restored {GEN1}",
           recover_s=round(recover_s, 3))
