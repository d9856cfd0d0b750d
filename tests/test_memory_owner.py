"""One owner per memory directory (issue 27, item 5) and persist at breakpoint (item 6),
without workers: the job's directory name, the exclusive claim, the sweep of dead launchers'
directories, removal by rename; a committed in-memory generation newer than the root's
persisted (verified, published), an older one left alone, a damaged one refused with why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_ckpt.errors import ConfigError
from dist_ckpt.format.manifest import MANIFEST_NAME, PENDING_PREFIX, read_latest_name
from dist_ckpt.format.validate import list_generations, validate
from dist_ckpt.launcher_api import MEMORY_DIR_ENV, memory_dir, persist_memory
from dist_ckpt.memory import paths as shm
from dist_ckpt.memory.breakpoint import persist_memory as persist_from
from dist_ckpt.memory.tier import memory_root
from dist_ckpt.storage.local import LocalStore
from launch import memory_dir as owner
from tests.helpers.handmade import flip_byte, write_generation


def _gone_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _record(directory: str, **fields) -> None:
    path = os.path.join(directory, owner.OWNER_NAME)
    record = json.load(open(path))
    record.update(fields)
    with open(path, "w") as handle:
        json.dump(record, handle)


# ---- the directory's name -------------------------------------------------------------------
def test_one_directory_per_job_and_the_workers_use_the_launchers(tmp_path, monkeypatch) -> None:
    first, second = memory_dir("0001", "/jobs/a"), memory_dir("0001", "/jobs/b")
    assert first != second and os.path.basename(first).startswith(f"{shm.PREFIX}0001-")
    monkeypatch.chdir(tmp_path)
    assert memory_dir("0001", "a") == memory_dir("0001", str(tmp_path / "a"))  # absolute root
    monkeypatch.delenv(MEMORY_DIR_ENV, raising=False)
    root = str(tmp_path / "root")
    assert memory_root(root, "0001") == os.path.join(memory_dir("0001", root), shm.root_digest(root))
    monkeypatch.setenv(MEMORY_DIR_ENV, str(tmp_path / "given"))
    assert memory_root(root, "0001") == os.path.join(str(tmp_path / "given"), shm.root_digest(root))
    monkeypatch.setenv(MEMORY_DIR_ENV, "")
    with pytest.raises(ConfigError, match=f"memory_tier.*{MEMORY_DIR_ENV} is empty"):
        memory_root(root, "0001")


# ---- the claim ------------------------------------------------------------------------------
def test_a_claim_is_exclusive_and_a_live_owner_is_never_overwritten(tmp_path) -> None:
    base = str(tmp_path)
    mine = owner.claim("0001", "/jobs/a", base)
    before = open(os.path.join(mine.path, owner.OWNER_NAME)).read()
    assert json.loads(before)["pid"] == os.getpid() and json.loads(before)["root"] == "/jobs/a"
    with pytest.raises(owner.OwnedElsewhere, match=f"launcher pid {os.getpid()}"):
        owner.claim("0001", "/jobs/a", base)  # another claimer: the lock is held
    assert open(os.path.join(mine.path, owner.OWNER_NAME)).read() == before
    other = owner.claim("0001", "/jobs/b", base)  # another job: its own directory
    assert other.path != mine.path
    # a record of a live launcher that took no lock (an older version) is not overwritten either
    mine.release()
    _record(mine.path, pid=os.getppid(), start_ticks=None)
    with pytest.raises(owner.OwnedElsewhere):
        owner.claim("0001", "/jobs/a", base)
    other.release()


def test_a_dead_owners_directory_is_taken_over(tmp_path) -> None:
    base = str(tmp_path)
    dead = owner.claim("0001", "/jobs/a", base)
    dead.release()  # as the kernel does when the launcher dies
    _record(dead.path, pid=_gone_pid())
    with open(os.path.join(dead.path, "kept"), "w") as handle:
        handle.write("x")
    taken = owner.claim("0001", "/jobs/a", base)
    assert taken.path == dead.path and os.path.exists(os.path.join(taken.path, "kept"))
    assert json.load(open(os.path.join(taken.path, owner.OWNER_NAME)))["pid"] == os.getpid()
    taken.release()


# ---- the sweep and removal ----------------------------------------------------------------
def test_the_sweep_removes_only_provably_dead_owners(tmp_path) -> None:
    base, gone = str(tmp_path), _gone_pid()
    alive = owner.claim("alive", "/r", base)
    _record(alive.path, pid=gone)  # its record lies, but the lock is held: alive
    dead = owner.claim("dead", "/r", base)
    dead.release()
    _record(dead.path, pid=gone)
    elsewhere = owner.claim("elsewhere", "/r", base)
    elsewhere.release()
    _record(elsewhere.path, pid=gone, host="another-host")
    os.makedirs(os.path.join(base, f"{shm.PREFIX}ownerless"))
    os.makedirs(os.path.join(base, f"{shm.REMOVING_PREFIX}{shm.PREFIX}half-1234"))
    os.makedirs(os.path.join(base, "unrelated"))
    assert owner.stale_reason(dead.path) == f"launcher pid {gone} is gone"
    assert owner.stale_reason(alive.path) is None
    assert owner.remove_stale(base) == [dead.path]
    assert sorted(os.listdir(base)) == sorted([os.path.basename(alive.path),
                                               os.path.basename(elsewhere.path),
                                               f"{shm.PREFIX}ownerless", "unrelated"])
    alive.release()


def test_removal_renames_first(tmp_path, monkeypatch) -> None:
    base = str(tmp_path)
    mine = owner.claim("0001", "/r", base)
    with open(os.path.join(mine.path, "blob"), "wb") as handle:
        handle.write(b"x" * 1000)
    assert mine.used_bytes() >= 1000
    monkeypatch.setattr(owner.shutil, "rmtree", lambda *a, **k: None)  # a removal cut short
    assert mine.remove() and mine.fd is None
    (left,) = os.listdir(base)
    assert left.startswith(shm.REMOVING_PREFIX), "a half-removed directory keeps no job's name"
    monkeypatch.undo()
    assert owner.remove_stale(base) == [] and os.listdir(base) == []
    assert owner.claim("0001", "/r", base).remove() and os.listdir(base) == []


# ---- persist at breakpoint -------------------------------------------------------------------
def _dirs(tmp_path) -> tuple[str, str, str]:
    root = str(tmp_path / "root")
    directory = str(tmp_path / "shm" / "job")
    memory = os.path.join(directory, shm.root_digest(root))
    os.makedirs(root)
    os.makedirs(memory)
    return root, directory, memory


def _no_pending(root: str) -> bool:
    return not any(name.startswith(PENDING_PREFIX) for name in os.listdir(root))


def test_a_newer_memory_generation_is_persisted_verified(tmp_path) -> None:
    root, directory, memory = _dirs(tmp_path)
    write_generation(root, 2)
    write_generation(memory, 3)
    write_generation(memory, 4)
    done = persist_memory(directory, root)
    assert done is not None and done.generation == "gen-000000000004"
    assert done.message == f"persisted gen-000000000004 from memory to {root}"
    validate(LocalStore(root), "gen-000000000004")  # digests too
    assert read_latest_name(LocalStore(root)) == "gen-000000000004"
    assert list_generations(LocalStore(root)) == ["gen-000000000004", "gen-000000000002"]
    assert _no_pending(root)
    assert persist_memory(directory, root) is None, "nothing newer any more"


def test_an_older_memory_generation_is_left_alone(tmp_path) -> None:
    root, directory, memory = _dirs(tmp_path)
    write_generation(root, 5)
    write_generation(memory, 4)
    write_generation(memory, 5)
    assert persist_memory(directory, root) is None
    assert list_generations(LocalStore(root)) == ["gen-000000000005"]
    assert persist_memory(str(tmp_path / "missing"), root) is None


def test_a_damaged_memory_generation_is_refused_with_its_reason(tmp_path) -> None:
    root, directory, memory = _dirs(tmp_path)
    write_generation(root, 2)
    write_generation(memory, 6)
    flip_byte(memory, "gen-000000000006", "dcp/__0_0.distcp")
    done = persist_memory(directory, root)
    assert done is not None and done.generation is None
    assert done.message.startswith("gen-000000000006 not persisted: ")
    assert "dcp/__0_0.distcp does not match its manifest entry" in done.message
    assert list_generations(LocalStore(root)) == ["gen-000000000002"] and _no_pending(root)
    # an intact older one newer than the root's is persisted instead, and the refusal said
    write_generation(memory, 5)
    done = persist_memory(directory, root)
    assert done is not None and done.generation == "gen-000000000005"
    assert "gen-000000000006 not persisted" in done.message
    validate(LocalStore(root), "gen-000000000005")


def test_each_node_brings_its_part_to_a_shared_root(tmp_path) -> None:
    root = str(tmp_path / "root")
    write_generation(root, 2, world_size=2)  # complete: a shared root
    nodes = [str(tmp_path / f"node{n}") for n in (0, 1)]
    for rank, memory in enumerate(nodes):
        write_generation(memory, 4, world_size=2, ranks={rank})
    first = persist_from(nodes[1], root, nodes=2)
    assert first is not None and first.generation is None and not first.complete
    assert "this node's part of gen-000000000004" in first.message
    assert list_generations(LocalStore(root)) == ["gen-000000000002"]
    second = persist_from(nodes[0], root, nodes=2)
    assert second is not None and second.generation == "gen-000000000004"
    validate(LocalStore(root), "gen-000000000004")
    assert _no_pending(root)


def test_a_node_local_root_gets_the_nodes_copy(tmp_path) -> None:
    root, memory = str(tmp_path / "root"), str(tmp_path / "node1")
    write_generation(root, 2, world_size=2, ranks={1})  # this node's copy: node-local disks
    write_generation(memory, 4, world_size=2, ranks={1})
    done = persist_from(memory, root, nodes=2)
    assert done is not None and done.generation == "gen-000000000004"
    assert "this node's copy" in done.message
    assert os.path.exists(os.path.join(root, "gen-000000000004", MANIFEST_NAME))
    assert os.path.exists(os.path.join(root, "gen-000000000004", "dcp", "__1_0.distcp"))
    assert read_latest_name(LocalStore(root)) == "gen-000000000004"
