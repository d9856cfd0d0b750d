"""The sweep of shared objects after pruning (issue 28, retention): kept generations' objects
survive, unreferenced ones go, pending attempts' manifests protect theirs, an unreadable
manifest refuses the sweep, a dry run only lists, a save that installs an object again
during a sweep keeps it, and ``dist-ckpt prune`` does the same on a root with objects."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from dist_ckpt import faults
from dist_ckpt.cli.app import main as cli_main
from dist_ckpt.format.manifest import MANIFEST_NAME, generation_name
from dist_ckpt.format.objects import (
    ASIDE_PREFIX,
    COPIES_DIR,
    Candidate,
    copy_path,
    recover_aside,
    remove_object,
    sweep_candidates,
)
from dist_ckpt.lifecycle.retention import prune
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.tiers import open_tier
from tests.helpers.finetune_jobs import Job
from tests.helpers.incremental_faults import (
    build,
    check_committed,
    object_refs,
    objects_on_disk,
    restored,
    same,
)

G = generation_name
# gens 1, 2 with the original base; base1 changed before 3: gens 3, 4 share base2's object
# with 1 and 2, and hold base1's new object
SAVES = [1, 2, -3, 4]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("incremental") / "root"
    saved = build(str(root), SAVES)
    return root, saved


@pytest.fixture
def root(template: tuple[Path, dict], tmp_path: Path) -> str:
    target = tmp_path / "root"
    shutil.copytree(template[0], target)
    return str(target)


def layout(root: str) -> tuple[set[str], set[str], set[str]]:
    """(objects only the old gens 1, 2 list, objects gens 3, 4 list, shared by both)."""
    refs = object_refs(root)
    old = refs[G(1)] | refs[G(2)]
    new = refs[G(3)] | refs[G(4)]
    return old - new, new, old & new


def test_template_shares_and_changes_objects(root: str) -> None:
    only_old, new, shared = layout(root)
    assert len(only_old) == 1 and len(shared) == 1 and len(new) == 2  # base1 changed, base2 shared
    assert objects_on_disk(root) == only_old | new


def test_kept_generations_objects_survive_unreferenced_go(root: str, template) -> None:
    only_old, new, _ = layout(root)
    removals = prune(open_tier(root), keep_last=2)
    assert removals.generations == [G(2), G(1)]
    assert removals.objects == sorted(only_old)
    assert objects_on_disk(root) == new  # base2's object, shared with the dropped ones, stays
    assert check_committed(root) == [G(3), G(4)]
    name, tensors = restored(root)
    assert name == G(4) and same(tensors, template[1][G(4)])
    assert prune(open_tier(root), keep_last=2).objects == []  # nothing left to sweep


def test_second_copies_go_with_their_objects(root: str) -> None:
    """Each object's second copy (``objects-copy/``, issue 38) is swept with it, kept with it."""
    only_old, new, _ = layout(root)
    copies = os.path.join(root, COPIES_DIR)
    assert {copy_path(p) for p in only_old | new} == {f"{COPIES_DIR}/{n}" for n in os.listdir(copies)}
    dry = prune(open_tier(root), keep_last=2, dry_run=True)
    assert dry.object_copies == [copy_path(p) for p in sorted(only_old)]
    removals = prune(open_tier(root), keep_last=2)
    assert removals.objects == sorted(only_old) and removals.object_copies == dry.object_copies
    assert {f"{COPIES_DIR}/{n}" for n in os.listdir(copies)} == {copy_path(p) for p in new}


def test_pending_attempt_manifest_protects_its_objects(root: str) -> None:
    only_old, new, _ = layout(root)
    # an attempt of gen 5 between its manifest and its rename, listing gen 1's objects
    pending = Path(root) / ".pending-gen-000000000005-abcd1234"
    pending.mkdir()
    (pending / MANIFEST_NAME).write_bytes((Path(root) / G(1) / MANIFEST_NAME).read_bytes())
    removals = prune(open_tier(root), keep_last=2)
    assert removals.generations == [G(2), G(1)] and removals.objects == []
    assert objects_on_disk(root) == only_old | new
    (pending / MANIFEST_NAME).unlink()  # the attempt went away: the next sweep frees them
    assert prune(open_tier(root), keep_last=2).objects == sorted(only_old)


@pytest.mark.parametrize("where", ["pending", "committed"])
def test_unparseable_manifest_refuses_the_sweep(root: str, where: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    only_old, new, _ = layout(root)
    if where == "pending":
        broken = Path(root) / ".pending-gen-000000000005-abcd1234" / MANIFEST_NAME
        broken.parent.mkdir()
    else:  # a newer generation whose manifest no longer parses: not committed, not debris
        broken = Path(root) / G(9) / MANIFEST_NAME
        broken.parent.mkdir()
    broken.write_bytes(b'{"format_version": 3, "files": [')
    removals = prune(open_tier(root), keep_last=2)
    assert removals.generations == [G(2), G(1)]  # the generations go; their objects wait
    assert removals.objects == []
    assert objects_on_disk(root) == only_old | new
    assert "not swept" in caplog.text and "does not parse" in caplog.text
    assert check_committed(root) == [G(3), G(4)]


def test_dry_run_lists_objects_and_deletes_nothing(root: str) -> None:
    only_old, new, _ = layout(root)
    before = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))
    removals = prune(open_tier(root), keep_last=2, dry_run=True)
    assert removals.generations == [G(2), G(1)] and removals.objects == sorted(only_old)
    assert sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")) == before


def test_object_installed_again_during_the_sweep_is_kept(tmp_path: Path, template) -> None:
    """A sweep judges an object unreferenced; before it removes it, a save installs the same
    name again (a fresh job from the same base writes every frozen weight anew) and commits a
    generation that lists it. The sweep must keep the fresh copy."""
    root = str(tmp_path / "root")
    build(root, [1])
    os.rename(os.path.join(root, G(1)), str(tmp_path / "gone"))  # deleted, not yet swept
    listed = sorted(objects_on_disk(root))
    assert len(listed) == 2
    faults.configure({"prune.objects_listed": {"block": "listed"}})
    result: dict = {}
    sweeper = threading.Thread(target=lambda: result.update(removals=prune(open_tier(root), keep_last=1)))
    sweeper.start()
    try:
        faults.wait_reached("listed", timeout_s=30)
        inodes = {p: os.stat(os.path.join(root, p)).st_ino for p in listed}
        saved = build(root, [5], job=Job("plain", 0, 1))  # same seed: the same base bytes
        assert {p: os.stat(os.path.join(root, p)).st_ino for p in listed} != inodes  # installed anew
        assert object_refs(root, [G(5)])[G(5)] == set(listed)
    finally:
        faults.release("listed")
        sweeper.join(timeout=30)
        faults.configure(None)
    assert not sweeper.is_alive()
    assert result["removals"].objects == []
    assert objects_on_disk(root) == set(listed)
    assert check_committed(root) == [G(5)]
    name, tensors = restored(root)
    assert name == G(5) and same(tensors, saved[G(5)])
    assert prune(open_tier(root), keep_last=1).objects == []  # still referenced


def test_aside_file_of_a_killed_sweep_is_put_back_or_deleted(root: str) -> None:
    only_old, _, _ = layout(root)
    store = LocalStore(root)
    (victim,) = only_old
    folder, name = os.path.split(os.path.join(root, victim))
    # killed after the rename aside: the name is missing, the bytes are aside
    os.rename(os.path.join(folder, name), os.path.join(folder, f"{ASIDE_PREFIX}{name}.0000dead"))
    assert recover_aside(store) == 1 and os.path.exists(os.path.join(folder, name))
    # aside while a fresh copy holds the name: the aside one goes
    os.link(os.path.join(folder, name), os.path.join(folder, f"{ASIDE_PREFIX}{name}.0000beef"))
    assert recover_aside(store) == 0
    assert not [n for n in os.listdir(folder) if n.startswith(ASIDE_PREFIX)]


def test_remove_object_keeps_a_different_inode(root: str) -> None:
    only_old, _, _ = layout(root)
    (victim,) = only_old
    path = os.path.join(root, victim)
    stale = os.stat(path)
    os.replace(path, path + ".tmp")  # a new inode under the same name, as an install makes
    with open(path + ".tmp", "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    os.unlink(path + ".tmp")
    assert not remove_object(LocalStore(root), Candidate(victim, (stale.st_dev, stale.st_ino)))
    assert os.path.exists(path)
    fresh = os.stat(path)
    assert remove_object(LocalStore(root), Candidate(victim, (fresh.st_dev, fresh.st_ino)))
    assert not os.path.exists(path)


def test_a_quarantined_generation_keeps_its_objects(root: str) -> None:
    only_old, new, _ = layout(root)
    # gens 1 and 2 rejected and moved aside (as restore or `dist-ckpt quarantine` does)
    rejected = Path(root) / "rejected"
    rejected.mkdir()
    os.rename(Path(root) / G(1), rejected / f"{G(1)}-20261203T000000Z-abcdef")
    os.rename(Path(root) / G(2), rejected / f"{G(2)}-20261203T000000Z-abcdef")
    assert prune(open_tier(root), keep_last=1).objects == []
    assert objects_on_disk(root) == only_old | new  # kept with the rejected entries
    for entry in list(rejected.iterdir()):
        shutil.rmtree(entry)  # the operator removes them: their objects go at the next sweep
    assert prune(open_tier(root), keep_last=2).objects == sorted(only_old)


def test_sweep_candidates_of_a_root_without_objects(tmp_path: Path) -> None:
    assert sweep_candidates(LocalStore(str(tmp_path))) == []


def test_cli_prune_on_a_root_with_objects(root: str, template, capsys: pytest.CaptureFixture) -> None:
    only_old, new, _ = layout(root)
    args = ["prune", root, "--keep-last", "2"]
    capsys.readouterr()
    assert cli_main([*args, "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["generations"] == [G(2), G(1)]
    assert dry["objects"] == sorted(only_old)
    assert objects_on_disk(root) == only_old | new  # a dry run deletes nothing
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert f"removed generation: {G(1)}" in out
    assert all(f"removed object: {path}" in out for path in only_old)
    assert objects_on_disk(root) == new
    assert check_committed(root) == [G(3), G(4)]
    name, tensors = restored(root)
    assert name == G(4) and same(tensors, template[1][G(4)])


# ---- quarantined incremental generations (issue 40, item 9) ----------------------------------
def test_a_quarantined_incremental_generation_validates_with_its_objects_and_is_put_back(
        root: str, capsys: pytest.CaptureFixture) -> None:
    """A quarantined manifest's shared objects are read at the root, where it keeps them: the
    entry is valid (rm --invalid-only leaves it), and unquarantine puts it back whole."""
    assert cli_main(["quarantine", root, G(3)]) == 0
    [entry] = os.listdir(Path(root) / "rejected")
    assert cli_main(["rm", root, entry, "--invalid-only"]) == 1
    assert "is valid" in capsys.readouterr().err
    assert cli_main(["unquarantine", root, entry]) == 0
    assert f"back as {G(3)}" in capsys.readouterr().out
    assert check_committed(root) == [G(1), G(2), G(3), G(4)]


def test_prune_of_old_quarantined_entries_sweeps_their_objects(root: str,
                                                               capsys: pytest.CaptureFixture) -> None:
    only_old, new, _ = layout(root)
    rejected = Path(root) / "rejected"
    rejected.mkdir()
    for name in (G(1), G(2)):  # quarantined long ago
        os.rename(Path(root) / name, rejected / f"{name}-20200101T000000Z-abcdef")
    args = ["prune", root, "--keep-last", "2", "--quarantined-older-than", "30d"]
    capsys.readouterr()
    assert cli_main([*args, "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["quarantined"] == [f"rejected/{G(2)}-20200101T000000Z-abcdef",
                                  f"rejected/{G(1)}-20200101T000000Z-abcdef"]
    assert dry["objects"] == sorted(only_old) and objects_on_disk(root) == only_old | new
    assert cli_main(args) == 0
    assert os.listdir(rejected) == [] and objects_on_disk(root) == new
    assert check_committed(root) == [G(3), G(4)]
