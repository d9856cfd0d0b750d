"""Small unit tests: codec, sampler, retention policy, shard hashing, config errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dist_ckpt import CheckpointConfig, ConfigError, ResumableSampler, UnsafeNameError
from dist_ckpt.digests import digest_bytes
from dist_ckpt.format.manifest import check_generation_name, check_relative_path, generation_name
from dist_ckpt.ops.retention import to_drop
from dist_ckpt.restart import codec
from dist_ckpt.save.shardio import hashing_writer
from dist_ckpt.storage.local import file_digest


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
