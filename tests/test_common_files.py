"""The common files of a node copy, in one process: rank 0's offer through the c10d store, a
leader's verified install (its memory's copy first), the size bound, and the keys withdrawn.
The two-node path end to end is tests/test_nodelocal.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.format.manifest import (
    COMMON_FILES,
    GLOBAL_STATE_FILE,
    MANIFEST_NAME,
    METADATA_FILE,
    Manifest,
    generation_name,
)
from dist_ckpt.protocol import messages
from dist_ckpt.protocol.comm import Comm
from dist_ckpt.replay import common_files
from tests.helpers.local_jobs import make_state, step

GEN = generation_name(1)


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One committed generation: its directory."""
    root = str(tmp_path_factory.mktemp("root"))
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        step(state)
        mgr.save(1)
    return os.path.join(root, GEN)


def manifest_of(directory: str) -> Manifest:
    with open(os.path.join(directory, MANIFEST_NAME), "rb") as handle:
        return Manifest.from_bytes(handle.read(), generation=GEN)


def reader(directory: str):
    def read(path: str) -> bytes:
        with open(os.path.join(directory, path), "rb") as handle:
            return handle.read()
    return read


def test_offered_bytes_are_installed_verified_then_withdrawn(committed: str, tmp_path: Path) -> None:
    comm, manifest = Comm(), manifest_of(committed)
    keys = common_files.offer(comm, "persist", 1, manifest, reader(committed))
    assert len(keys) == len(COMMON_FILES) + 1  # each file, then the offer
    memory, target = str(tmp_path / "memory"), str(tmp_path / "pending")  # memory lacks them
    assert common_files.install(comm, "persist", 1, manifest, memory, target) == []
    for path in COMMON_FILES:
        assert reader(target)(path) == reader(committed)(path)
    common_files.withdraw(comm, keys)
    assert not any(comm.store.check([k]) for k in keys)


def test_damaged_offered_bytes_are_never_installed(committed: str, tmp_path: Path) -> None:
    comm, manifest = Comm(), manifest_of(committed)
    common_files.offer(comm, "persist", 2, manifest, reader(committed))
    key = messages.replay_common_key("persist", 2, GEN, METADATA_FILE)
    damaged = bytearray(comm.store_get(key))
    damaged[len(damaged) // 2] ^= 1
    comm.store_set(key, bytes(damaged))
    target = str(tmp_path / "pending")
    missing = common_files.install(comm, "persist", 2, manifest, str(tmp_path / "memory"), target)
    assert len(missing) == 1 and METADATA_FILE in missing[0] and "does not match" in missing[0]
    assert not os.path.exists(os.path.join(target, METADATA_FILE))
    assert reader(target)(GLOBAL_STATE_FILE) == reader(committed)(GLOBAL_STATE_FILE)  # intact: in


def test_the_nodes_own_intact_copy_is_used_and_a_damaged_one_is_not(committed: str, tmp_path: Path) -> None:
    comm, manifest = Comm(), manifest_of(committed)
    memory = str(tmp_path / "memory")
    shutil.copytree(committed, memory)
    # nothing offered: every common file comes from this node's memory
    assert common_files.install(comm, "persist", 3, manifest, memory, str(tmp_path / "a")) == []
    # a flipped bit in memory: the offered bytes replace it
    with open(os.path.join(memory, METADATA_FILE), "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 1]))
    common_files.offer(comm, "persist", 4, manifest, reader(committed))
    target = str(tmp_path / "b")
    assert common_files.install(comm, "persist", 4, manifest, memory, target) == []
    assert reader(target)(METADATA_FILE) == reader(committed)(METADATA_FILE)


def test_over_the_bound_nothing_is_offered_and_the_reason_is_given(committed: str, tmp_path: Path) -> None:
    comm, manifest = Comm(), manifest_of(committed)
    keys = common_files.offer(comm, "persist", 5, manifest, reader(committed), limit=1)
    assert keys == [messages.replay_common_key("persist", 5, GEN)]  # the offer alone: no bytes
    target = str(tmp_path / "pending")
    missing = common_files.install(comm, "persist", 5, manifest, str(tmp_path / "memory"), target)
    assert len(missing) == len(COMMON_FILES) and all("over the 1 bytes" in m for m in missing)
    assert not os.path.exists(target)
