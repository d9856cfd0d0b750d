"""The power-loss filesystem itself (tests/helpers/powerfs.py): what a cut keeps and undoes.

Each test mounts a PowerFS over a backing directory whose initial contents are durable,
changes things through the mount, cuts the power and reads the rebuilt backing directory.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.helpers.powerfs import PowerFS, is_mounted

pytestmark = [pytest.mark.usefixtures("require_fuse"), pytest.mark.timeout(120)]


def write(path: str, data: bytes, *, sync: bool = False) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        if sync:
            os.fsync(handle.fileno())


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) below ``root``, by relative path."""
    found: dict[str, bytes | None] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(folder, name), root)] = None
        for name in files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = Path(path).read_bytes()
    return found


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    root = tmp_path / "backing"
    (root / "sub").mkdir(parents=True)
    (root / "a").write_bytes(b"a-old")
    (root / "b").write_bytes(b"b-old")
    (root / "sub" / "x").write_bytes(b"x-old")
    return root


BASELINE = {"a": b"a-old", "b": b"b-old", "sub": None, "sub/x": b"x-old"}


def test_unsynced_write_is_undone(backing: Path) -> None:
    with PowerFS(backing) as fs:
        write(os.path.join(fs.mountpoint, "a"), b"a-new")  # flush and close: not durable
        with open(os.path.join(fs.mountpoint, "b"), "ab") as handle:
            handle.write(b"+tail")
        assert Path(fs.mountpoint, "a").read_bytes() == b"a-new"
        assert (backing / "a").read_bytes() == b"a-new"  # live: passed through
        assert fs.points() == 0
        fs.cut()
    assert tree(backing) == BASELINE


def test_unsynced_rename_is_undone(backing: Path) -> None:
    with PowerFS(backing) as fs:
        os.rename(os.path.join(fs.mountpoint, "a"), os.path.join(fs.mountpoint, "renamed"))
        os.rename(os.path.join(fs.mountpoint, "sub", "x"), os.path.join(fs.mountpoint, "b"))
        assert fs.log() == [("rename", "/a -> /renamed"), ("rename", "/sub/x -> /b")]
        fs.cut()
    assert tree(backing) == BASELINE


def test_unsynced_unlink_and_rmdir_are_undone(backing: Path) -> None:
    with PowerFS(backing) as fs:
        os.unlink(os.path.join(fs.mountpoint, "a"))
        os.unlink(os.path.join(fs.mountpoint, "sub", "x"))
        os.rmdir(os.path.join(fs.mountpoint, "sub"))
        assert sorted(os.listdir(fs.mountpoint)) == ["b"]
        fs.cut()
    assert tree(backing) == BASELINE


def test_synced_changes_survive(backing: Path) -> None:
    with PowerFS(backing) as fs:
        mnt = fs.mountpoint
        write(os.path.join(mnt, "a"), b"a-new", sync=True)          # rewrite in place
        write(os.path.join(mnt, "c"), b"c-new", sync=True)          # new file
        os.rename(os.path.join(mnt, "b"), os.path.join(mnt, "b2"))  # rename
        os.unlink(os.path.join(mnt, "sub", "x"))                    # unlink
        os.mkdir(os.path.join(mnt, "new"))                          # mkdir + file inside
        write(os.path.join(mnt, "new", "y"), b"y-new", sync=True)
        sync_dir(os.path.join(mnt, "new"))
        sync_dir(os.path.join(mnt, "sub"))
        sync_dir(mnt)
        assert [kind for kind, _ in fs.log()] == ["fsync", "fsync", "rename", "fsync",
                                                  "fsyncdir", "fsyncdir", "fsyncdir"]
        fs.cut()
    assert tree(backing) == {"a": b"a-new", "b2": b"b-old", "c": b"c-new", "sub": None,
                             "new": None, "new/y": b"y-new"}


def test_fsynced_file_in_unsynced_directory_disappears(backing: Path) -> None:
    with PowerFS(backing) as fs:
        mnt = fs.mountpoint
        write(os.path.join(mnt, "fresh"), b"data", sync=True)       # root never fsynced
        os.mkdir(os.path.join(mnt, "d"))
        write(os.path.join(mnt, "d", "z"), b"z", sync=True)
        sync_dir(os.path.join(mnt, "d"))                            # d's entries, not d itself
        fs.cut()
    assert tree(backing) == BASELINE


def test_durable_entry_without_fsynced_bytes_comes_back_empty(backing: Path) -> None:
    with PowerFS(backing) as fs:
        write(os.path.join(fs.mountpoint, "c"), b"never fsynced")
        os.mkdir(os.path.join(fs.mountpoint, "e"))
        write(os.path.join(fs.mountpoint, "e", "w"), b"w", sync=True)  # e never fsynced
        sync_dir(fs.mountpoint)
        fs.cut()
    assert tree(backing) == {**BASELINE, "c": b"", "e": None}


def test_fsync_follows_the_inode_across_renames(backing: Path) -> None:
    with PowerFS(backing) as fs:
        mnt = fs.mountpoint
        # the atomic-replace pattern: tmp written and fsynced, renamed over, directory fsynced
        write(os.path.join(mnt, ".a.tmp"), b"a-replaced", sync=True)
        os.replace(os.path.join(mnt, ".a.tmp"), os.path.join(mnt, "a"))
        sync_dir(mnt)
        # a durable name, renamed without a directory fsync, then written and fsynced under
        # the new name: the bytes are durable under the name the directory durably records
        os.rename(os.path.join(mnt, "b"), os.path.join(mnt, "b-moved"))
        with open(os.path.join(mnt, "b-moved"), "r+b") as handle:
            handle.write(b"B-NEW")
            handle.flush()
            os.fdatasync(handle.fileno())
        fs.cut()
    assert tree(backing) == {**BASELINE, "a": b"a-replaced", "b": b"B-NEW"}


@pytest.mark.parametrize("after, expected", [
    (0, BASELINE),                                   # frozen before anything
    (1, BASELINE),                                   # c's bytes durable, its entry not
    (2, {**BASELINE, "c": b"c"}),                    # root fsynced: c survives
    (3, {**BASELINE, "c": b"c"}),                    # the rename alone is not durable
    (4, {"a": b"a-old", "b": b"b-old", "sub": None, "sub/x": b"x-old", "d": b"c"}),
])
def test_arm_freezes_after_the_kth_point(backing: Path, after: int, expected: dict) -> None:
    with PowerFS(backing) as fs:
        mnt = fs.mountpoint
        fs.arm(after=after)
        write(os.path.join(mnt, "c"), b"c", sync=True)               # 1 fsync
        sync_dir(mnt)                                                # 2 fsyncdir
        os.rename(os.path.join(mnt, "c"), os.path.join(mnt, "d"))   # 3 rename
        sync_dir(mnt)                                                # 4 fsyncdir
        write(os.path.join(mnt, "a"), b"after the freeze", sync=True)  # 5 fsync
        sync_dir(mnt)                                                # 6 fsyncdir
        # frozen or not, the writer sees every change succeed
        assert Path(mnt, "a").read_bytes() == b"after the freeze"
        assert fs.points() == 6
        result = fs.cut()
        assert result["frozen_at"] == after
    assert tree(backing) == expected


def test_unmounts_when_the_block_raises(backing: Path) -> None:
    fs = PowerFS(backing)
    with pytest.raises(RuntimeError, match="boom"), fs:
        mountpoint = fs.mountpoint
        assert is_mounted(mountpoint)
        handle = open(os.path.join(mountpoint, "a"), "rb")  # still open at the unmount
        raise RuntimeError("boom")
    with contextlib.suppress(OSError):  # its server is gone: ENOTCONN
        handle.close()
    assert not is_mounted(mountpoint)
    assert not fs.mounted
    assert tree(backing) == BASELINE  # no cut: the backing directory keeps the live state


def test_available_reports_a_reason() -> None:
    ok, reason = PowerFS.available()
    assert ok and reason == ""
