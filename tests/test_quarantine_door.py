"""Quarantine is not a one-way door (issue 40, item 9): ``ls`` lists both kinds of entry under
``ROOT/rejected/`` (a generation moved aside, the damaged files a repair replaced), ``rm
--quarantined`` deletes either kind, valid or not, ``unquarantine`` puts a generation back (only
where its name is free, only if it validates, latest.json never moved back), and ``prune
--quarantined-older-than`` deletes entries by age."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.format.manifest import (
    MANIFEST_NAME,
    REASON_NAME,
    REJECTED_DIR,
    parse_rejected_entry,
    rejected_entry_name,
    rejected_files_entry_name,
    rejected_generation,
)
from dist_ckpt.format.validate import Problem
from dist_ckpt.tiers.rejected import move_aside, replace_file
from tests.helpers.cli_runs import flip_byte, run, two_generation_roots
from tests.helpers.local_jobs import make_state
from tests.helpers.roots import make_two_gen_root

GEN1 = "gen-000000000001"
GEN2 = "gen-000000000002"
SHARD = "dcp/__0_0.distcp"
OLD = "20200101T000000Z"  # a quarantine long ago (the time is read from the entry's name)


# root: a private copy of gen-1 and gen-2 (latest.json -> gen-2), free to damage
template, root = two_generation_roots("door-template")


def quarantine(root: Path, generation: str, reason: str = "operator") -> str:
    """Move ``generation`` aside as restore and ``dist-ckpt quarantine`` do; its entry's name."""
    moved = move_aside(str(root), Problem(generation, reason))
    assert moved is not None
    return os.path.basename(moved)


def files_entry(root: Path) -> str:
    """A repair of gen-2's shard (as restore does): the copy it replaced goes to a files entry,
    gen-2 stays committed. The entry's name."""
    fresh = root / ".fresh"
    shutil.copyfile(root / GEN2 / SHARD, fresh)
    kept = replace_file(str(root), GEN2, SHARD, str(fresh), "does not match its manifest entry")
    assert kept is not None
    return os.path.basename(kept)


def entries(root: Path) -> list[str]:
    rejected = root / REJECTED_DIR
    return sorted(os.listdir(rejected)) if rejected.exists() else []


def latest_of(root: Path) -> str | None:
    path = root / "latest.json"
    return json.loads(path.read_text())["generation"] if path.exists() else None


def age(root: Path, entry: str) -> str:
    """Rename an entry as if it had been quarantined on 2020-01-01; its new name."""
    parsed = parse_rejected_entry(entry)
    assert parsed is not None
    old = entry.replace(parsed.time_text.replace("-", "").replace(":", ""), OLD)
    os.rename(root / REJECTED_DIR / entry, root / REJECTED_DIR / old)
    return old


# ---- names of both kinds ------------------------------------------------------------------
def test_entry_names_of_both_kinds_parse() -> None:
    entry = parse_rejected_entry(rejected_entry_name(GEN2))
    files = parse_rejected_entry(rejected_files_entry_name(GEN2))
    assert entry is not None and files is not None
    assert (entry.generation, entry.kind, files.generation, files.kind) == (GEN2, "generation", GEN2, "files")
    assert files.path == f"{REJECTED_DIR}/{files.name}" and abs(entry.time - files.time) < 5
    old = parse_rejected_entry(f"{GEN1}-files-{OLD}-abcdef")
    assert old is not None and old.time_text == "2020-01-01T00:00:00Z"
    # a files entry holds no generation (the object store's markers name generation entries)
    assert rejected_generation(files.name) is None and rejected_generation(entry.name) == GEN2
    for bad in (f"../{GEN1}-{OLD}-abcdef", f"{GEN1}-20201399T000000Z-abcdef", f"{GEN1}-{OLD}-ABCDEF",
                f"{GEN1}-file-{OLD}-abcdef", GEN1, f"{GEN1}-{OLD}-abcdef/x"):
        assert parse_rejected_entry(bad) is None, bad


# ---- ls -----------------------------------------------------------------------------------
def test_ls_lists_both_kinds_with_kind_time_and_reason(root: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    moved = quarantine(root, GEN1, "loss diverged")
    files = files_entry(root)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    files_row = next(line for line in out.splitlines() if files in line)
    assert f"{REJECTED_DIR}/{files}" in files_row and "quarantined files" in files_row
    assert SHARD in files_row and "does not match" in files_row
    assert any(moved in line and "loss diverged" in line for line in out.splitlines())
    assert "unquarantine" in out and "--quarantined" in out  # how to put back or delete

    code, out, _ = run(capsys, "ls", str(root), "--json")
    records = {rec["name"]: rec for rec in json.loads(out)["quarantined"]}
    assert code == 0 and set(records) == {moved, files}
    assert (records[files]["kind"], records[files]["generation"], records[files]["path"]) == (
        "files", GEN2, f"{REJECTED_DIR}/{files}")
    assert records[moved]["kind"] == "generation" and records[moved]["next_update"] == 1
    for name, rec in records.items():
        parsed = parse_rejected_entry(name)
        assert parsed is not None and rec["time"] == parsed.time_text and rec["total_bytes"] > 0


# ---- rm --quarantined ---------------------------------------------------------------------
def test_rm_quarantined_deletes_a_valid_entry_and_a_files_entry(root: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    valid = quarantine(root, GEN1)
    files = files_entry(root)
    code, out, _ = run(capsys, "rm", str(root), f"{REJECTED_DIR}/{valid}", "--quarantined")
    assert code == 0 and out.startswith(f"deleted {REJECTED_DIR}/{valid} (quarantined: ")
    code, out, _ = run(capsys, "rm", str(root), files, "--quarantined", "--json")
    assert code == 0 and json.loads(out)["deleted"] == f"{REJECTED_DIR}/{files}"
    assert entries(root) == []
    code, out, _ = run(capsys, "verify", str(root), GEN2)  # the repaired generation is untouched
    assert code == 0 and "OK" in out


def test_rm_invalid_only_takes_a_files_entry_and_points_a_valid_one_at_the_way_out(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = files_entry(root)
    valid = quarantine(root, GEN1)
    code, out, _ = run(capsys, "rm", str(root), files, "--invalid-only")
    assert code == 0 and f"deleted {REJECTED_DIR}/{files}" in out  # damaged copies, nothing valid
    code, _, err = run(capsys, "rm", str(root), valid, "--invalid-only")
    assert code == 1 and "is valid" in err and "--quarantined" in err and "unquarantine" in err
    assert entries(root) == [valid]


@pytest.mark.parametrize("argv, message", [
    ([GEN2, "--quarantined"], "is a generation in the root"),
    ([f"{REJECTED_DIR}/../{GEN1}", "--quarantined"], "neither a generation name nor a quarantined entry"),
    ([f"{GEN1}-files-{OLD}-abcdef", "--quarantined"], "no quarantined entry"),
    ([GEN2], "--quarantined for an entry"),
    ([GEN2, "--quarantined", "--invalid-only"], "not allowed with"),
])
def test_rm_quarantined_refusals(root: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                 message: str) -> None:
    code, out, err = run(capsys, "rm", str(root), *argv)
    assert code == 2 and out == "" and message in err
    assert (root / GEN1 / MANIFEST_NAME).exists() and (root / GEN2 / MANIFEST_NAME).exists()


# ---- unquarantine -------------------------------------------------------------------------
def test_unquarantine_puts_back_a_generation_that_verify_and_restore_use(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "quarantine", str(root), GEN2, "--force")
    [entry] = entries(root)
    assert code == 0 and latest_of(root) == GEN1 and not (root / GEN2).exists()
    code, out, _ = run(capsys, "unquarantine", str(root), f"{REJECTED_DIR}/{entry}")
    assert code == 0 and out.startswith(f"put {REJECTED_DIR}/{entry} back as {GEN2}")
    assert f"latest.json now names {GEN2} (it named {GEN1})" in out and latest_of(root) == GEN2
    assert entries(root) == [] and not (root / GEN2 / REASON_NAME).exists()
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and f"{GEN2}: OK" in out
    with CheckpointManager(CheckpointConfig(root=str(root)), make_state()) as mgr:
        result = mgr.restore()
    assert result.generation == GEN2 and result.next_update == 2 and result.rejected == []


def test_unquarantine_of_an_older_generation_leaves_latest(root: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    entry = quarantine(root, GEN1)
    code, out, _ = run(capsys, "unquarantine", str(root), entry, "--json")
    result = json.loads(out)
    assert code == 0 and result == {"entry": f"{REJECTED_DIR}/{entry}", "generation": GEN1,
                                     "path": str(root / GEN1), "latest": None}
    assert latest_of(root) == GEN2 and (root / GEN1 / MANIFEST_NAME).exists()
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert [g["name"] for g in json.loads(out)["generations"]] == [GEN2, GEN1]


def test_unquarantine_never_replaces_what_holds_the_name(root: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    entry = quarantine(root, GEN1)
    shutil.copytree(root / REJECTED_DIR / entry, root / GEN1)  # saved again meanwhile, say
    (root / GEN1 / REASON_NAME).unlink()
    before = sorted(p.name for p in (root / GEN1).rglob("*"))
    code, out, err = run(capsys, "unquarantine", str(root), entry)
    assert code == 1 and out == "" and f"{GEN1} already exists" in err
    assert entries(root) == [entry] and sorted(p.name for p in (root / GEN1).rglob("*")) == before
    shutil.rmtree(root / GEN1)
    (root / GEN1 / "dcp").mkdir(parents=True)  # a directory without a manifest holds the name too
    code, _, err = run(capsys, "unquarantine", str(root), entry)
    assert code == 1 and "already exists" in err and entries(root) == [entry]


def test_unquarantine_refuses_an_entry_that_does_not_validate(root: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    entry = quarantine(root, GEN1, "shard damaged")
    flip_byte(root / REJECTED_DIR / entry / SHARD)  # the size still matches: only digests see it
    code, out, err = run(capsys, "unquarantine", str(root), entry)
    assert code == 1 and out == "" and "does not validate" in err and SHARD in err
    assert entries(root) == [entry] and not (root / GEN1).exists() and latest_of(root) == GEN2


def test_unquarantine_refuses_a_files_entry(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = files_entry(root)
    code, out, err = run(capsys, "unquarantine", str(root), files)
    assert code == 1 and out == "" and "nothing to put back" in err
    assert f"dist-ckpt rm {root} {REJECTED_DIR}/{files} --quarantined" in err
    assert entries(root) == [files]


@pytest.mark.parametrize("name, message", [
    (GEN1, "is a generation name"),
    (f"{REJECTED_DIR}/../{GEN1}", "neither a generation name nor a quarantined entry"),
    (f"{GEN1}-{OLD}-abcdef", "no quarantined entry"),
])
def test_unquarantine_usage_errors(root: Path, capsys: pytest.CaptureFixture[str], name: str,
                                   message: str) -> None:
    code, out, err = run(capsys, "unquarantine", str(root), name)
    assert code == 2 and out == "" and message in err


# ---- prune --quarantined-older-than -------------------------------------------------------
def test_prune_deletes_quarantined_entries_by_age(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = age(root, quarantine(root, GEN1))
    old_files = age(root, files_entry(root))
    recent = files_entry(root)
    args = ["prune", str(root), "--quarantined-older-than", "30d"]  # no --keep-last: no generation goes
    code, out, _ = run(capsys, *args, "--dry-run", "--json")
    result = json.loads(out)
    assert code == 0 and result["generations"] == [] and result["kept"] == 1
    assert sorted(result["quarantined"]) == sorted(f"{REJECTED_DIR}/{e}" for e in (old, old_files))
    assert entries(root) == sorted([old, old_files, recent])  # a dry run deletes nothing
    code, out, _ = run(capsys, *args)
    assert code == 0 and f"removed quarantined entry: {REJECTED_DIR}/{old}" in out
    assert entries(root) == [recent] and (root / GEN2 / MANIFEST_NAME).exists()
    code, out, _ = run(capsys, *args)
    assert code == 0 and out == ("nothing to prune: 1 generation(s) kept (no --keep-last: no "
                                 "generation goes, 1 quarantined entry newer than 30d)\n")


def test_prune_quarantined_refusals(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "prune", str(root), "--quarantined-older-than", "soon")
    assert code == 2 and out == "" and "invalid duration" in err
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--json")
    assert code == 0 and "quarantined" not in json.loads(out)  # only when asked for


# ---- an object store ----------------------------------------------------------------------
def test_unquarantine_and_rm_quarantined_on_an_object_store(s3_endpoint: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    gens = make_two_gen_root("s3", "")
    url = gens.url
    assert run(capsys, "quarantine", url, GEN1)[0] == 0
    [entry] = gens.rejected_entries()
    # a put-back cut short after its copy: the files are back below GEN1, no manifest yet
    for rel in gens.store.find(f"{REJECTED_DIR}/{entry}"):
        name = rel.removeprefix(f"{REJECTED_DIR}/{entry}/")
        if name not in (MANIFEST_NAME, REASON_NAME):
            gens.store.copy(rel, f"{GEN1}/{name}")
    code, out, err = run(capsys, "unquarantine", url, entry, "--json")
    assert code == 0, err
    assert json.loads(out)["generation"] == GEN1 and gens.rejected_entries() == []
    code, out, _ = run(capsys, "verify", url, "--all")
    assert code == 0 and f"{GEN1}: OK" in out and latest_of_store(gens) == GEN2
    # a valid entry goes with --quarantined
    assert run(capsys, "quarantine", url, GEN1)[0] == 0
    [entry] = gens.rejected_entries()
    code, out, _ = run(capsys, "rm", url, entry, "--quarantined")
    assert code == 0 and gens.rejected_entries() == [] and not gens.store.exists(f"{GEN1}/{MANIFEST_NAME}")


def latest_of_store(gens) -> str:
    return json.loads(gens.store.read_bytes("latest.json"))["generation"]
