"""Small unit tests: codec, sampler, retention policy, shard hashing, config errors, root names,
the latest pointer's reader, DCP failure unwrapping."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from dist_ckpt import CheckpointConfig, ConfigError, ResumableSampler, UnsafeNameError
from dist_ckpt.digests import digest_bytes
from dist_ckpt.errors import StorageError, ValidationError
from dist_ckpt.format.manifest import (
    LATEST_NAME,
    check_generation_name,
    check_relative_path,
    generation_name,
    pending_dir_name,
    pending_update,
    read_latest_name,
    read_latest_pointer,
    rejected_entry_name,
    rejected_generation,
)
from dist_ckpt.lifecycle.retention import to_drop
from dist_ckpt.restart import codec
from dist_ckpt.restore.loader import load_in_process, verification_failures
from dist_ckpt.save.shardio import hashing_writer
from dist_ckpt.storage.local import LocalStore, atomic_write, file_digest


def test_codec_round_trip_without_pickle() -> None:
    value = {"t": torch.arange(6, dtype=torch.int16).reshape(2, 3), "a": np.arange(4.0),
             "tuple": (1, "x", None), 3: [1.5, float("inf")], "empty": torch.empty(0)}
    back = codec.loads(codec.dumps(value))
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.int16
    assert np.array_equal(back["a"], value["a"]) and back["tuple"] == (1, "x", None)
    assert back[3] == [1.5, float("inf")] and back["empty"].numel() == 0


def test_sampler_exactly_once_across_world_sizes() -> None:
    old = [ResumableSampler(50, 3, rank=r, world_size=4, seed=1) for r in range(4)]
    consumed = [i for _ in range(2) for s in old for i in s.next_batch()]
    state = old[0].state_dict()
    new = [ResumableSampler(50, 3, rank=r, world_size=3, seed=1) for r in range(3)]
    for sampler in new:
        sampler.load_state_dict(state)
    remaining = [i for s in new for batch in s for i in batch]
    assert sorted(consumed + remaining) == list(range(50))
    with pytest.raises(Exception, match="num_samples"):
        ResumableSampler(51, 3, rank=0, world_size=1, seed=1).load_state_dict(state)


def test_retention_orders_numerically_and_keeps_pins() -> None:
    names = [generation_name(n) for n in (9, 100, 10, 11)]
    assert to_drop(names, keep_last=2) == [generation_name(10), generation_name(9)]
    assert to_drop(names, keep_last=2, pinned=frozenset({generation_name(9)})) == [generation_name(10)]
    # milestones: update numbers that are multiples of keep_every survive
    assert to_drop(names, keep_last=1, keep_every=10) == [generation_name(11), generation_name(9)]


@pytest.mark.parametrize("name", ["../gen-000000000001", "/etc", "gen-1", "gen-000000000001/..", ""])
def test_unsafe_generation_names(name: str) -> None:
    with pytest.raises(UnsafeNameError):
        check_generation_name(name)


@pytest.mark.parametrize("path", ["../x", "/abs", "a//b", "a/../b", "a\\b", "."])
def test_unsafe_file_names(path: str) -> None:
    with pytest.raises(UnsafeNameError):
        check_relative_path(path)


def test_root_names_are_built_and_parsed_in_one_module() -> None:
    pending = pending_dir_name(generation_name(30), "abcd1234")
    assert pending == ".pending-gen-000000000030-abcd1234" and pending_update(pending) == 30
    for name in (generation_name(30), ".pending-gen-00000000003x-ab", ".pending-gen-0000000000300-ab",
                 ".pending-gen-000000000030\n", ".pending-gen-\u0663\u0663"):
        assert pending_update(name) is None, name
    entry = rejected_entry_name(generation_name(2))
    assert rejected_generation(entry) == generation_name(2) != rejected_generation(f"{entry}\n")
    for other in (generation_name(2), f"../{entry}", f"{entry}-x", pending):
        assert rejected_generation(other) is None, other


class _Unreadable(LocalStore):
    def read_bytes(self, rel: str) -> bytes:
        raise PermissionError(13, "Permission denied", rel)


def test_latest_pointer_missing_or_unreadable(tmp_path) -> None:
    """The cases the one reader of the pointer tells apart that need no generation (the
    hostile ones: tests/faults/test_hostile.py)."""
    with pytest.raises(FileNotFoundError):
        read_latest_pointer(LocalStore(str(tmp_path)))
    atomic_write(str(tmp_path / LATEST_NAME), b"{}")
    with pytest.raises(StorageError, match=f"cannot read .*{LATEST_NAME}: .*Permission denied"):
        read_latest_pointer(_Unreadable(str(tmp_path)))
    with pytest.raises(ValidationError, match=f"{LATEST_NAME} is corrupt: generation: Field required"):
        read_latest_pointer(LocalStore(str(tmp_path)))
    assert read_latest_name(_Unreadable(str(tmp_path))) is None
    assert os.listdir(tmp_path) == [LATEST_NAME]  # the atomic write left no temporary file


def _raising(failure: BaseException) -> Callable[..., None]:
    def load(*args: object, **kwargs: object) -> None:
        raise failure
    return load


def test_dcp_verification_failures_are_unwrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    ours, mine, other = ValidationError("bad shard", path="dcp/x"), ValidationError("mine"), RuntimeError("x")
    wrapped = CheckpointException("read", {0: (other, None), 1: (ours, None)})  # type: ignore[dict-item]
    assert verification_failures(wrapped, []) == {1: ours}
    assert verification_failures(wrapped, [mine], rank=0) == {0: mine, 1: ours}
    assert verification_failures(wrapped, [mine], rank=1) == {1: ours}  # DCP's word first
    assert verification_failures(other, []) == {}
    reader = SimpleNamespace(storage_reader=None, errors=[])
    monkeypatch.setattr(dcp, "load", _raising(wrapped))
    with pytest.raises(ValidationError) as raised:
        load_in_process({}, reader)  # type: ignore[arg-type]
    assert raised.value is ours and raised.value.__cause__ is wrapped
    unrelated = CheckpointException("read", {0: (other, None)})  # type: ignore[dict-item]
    monkeypatch.setattr(dcp, "load", _raising(unrelated))
    with pytest.raises(CheckpointException) as raised_other:
        load_in_process({}, reader)  # type: ignore[arg-type]
    assert raised_other.value is unrelated  # not a verification failure: as DCP raised it


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_shard_digests_are_computed_while_writing(tmp_path, algorithm: str) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    state = {"w": torch.randn(300, 300), "obj": {"k": 1}}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, _ = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(plans[0].__class__(plans[0].items, storage_data=_StoragePrefix("__0_")))
    writer, filesystem = hashing_writer(str(tmp_path), thread_count=2, algorithm=algorithm)
    writer.write_data(plan, planner).wait()
    assert filesystem.digests
    for name, (size, digest) in filesystem.digests.items():
        assert file_digest(os.path.join(tmp_path, name), algorithm) == (size, digest)
        with open(os.path.join(tmp_path, name), "rb") as handle:  # against the reference hash
            assert digest_bytes(handle.read(), algorithm) == digest


def test_config_errors_name_the_field(monkeypatch) -> None:
    monkeypatch.delenv("DIST_CKPT_ROOT", raising=False)
    with pytest.raises(ConfigError, match="root"):
        CheckpointConfig()
    with pytest.raises(ConfigError, match="max_in_flight"):
        CheckpointConfig(root="x", max_in_flight=0)
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointConfig(root="x", async_save=True, keep_last=1)
    monkeypatch.setenv("DIST_CKPT_ROOT", "s3://bucket/run")
    assert CheckpointConfig().root == "s3://bucket/run"
