"""The CLI's rough edges of issue 29: what ``verify ROOT`` and ``diff ROOT`` look at, short
generation names, ``prune`` with nothing to remove, ``quarantine`` said once."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.cli_runs import flip_byte, private_copy, run
from tests.helpers.local_jobs import make_state, step

GEN1, GEN2, GEN3 = (f"gen-{n:012d}" for n in (1, 2, 3))
SHARD = "dcp/__0_0.distcp"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dist_ckpt import CheckpointConfig, CheckpointManager

    root = tmp_path_factory.mktemp("edges-template")
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=str(root)), state) as mgr:
        for update in (1, 2, 3):
            step(state)
            mgr.save(update)
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    """A private copy of gen-1, gen-2 and gen-3 (latest.json -> gen-3), free to damage."""
    return private_copy(template, tmp_path)




def point_latest_at(root: Path, name: str) -> None:
    """latest.json as it was when ``name`` was the newest (a pointer that lags a newer save)."""
    pointer = json.loads((root / "latest.json").read_text())
    manifest_of = json.loads((root / name / "manifest.json").read_text())
    pointer.update(generation=name, next_update=manifest_of["next_update"])
    (root / "latest.json").write_text(json.dumps(pointer))


# ---- item 7: verify ROOT and diff ROOT never pass over a broken newest generation ----------
def test_verify_root_fails_on_the_generation_latest_names(root: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(root / GEN3 / SHARD)  # sizes match: only digests find it
    code, out, err = run(capsys, "verify", str(root))
    assert code == 1 and f"{GEN3}: INVALID" in out and GEN2 not in out and "note:" not in err
    code, out, _ = run(capsys, "verify", str(root), "--json")
    data = json.loads(out)
    assert code == 1 and (data["generation"], data["ok"], data["all_ok"]) == (GEN3, False, False)
    # --newest-valid passes over what fails structure or sizes only: digests are read after
    code, out, _ = run(capsys, "verify", str(root), "--newest-valid")
    assert code == 1 and f"{GEN3}: INVALID" in out


def test_verify_root_checks_newer_committed_looking_generations(root: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (root / GEN3 / SHARD).write_bytes(b"short")  # newest invalid, with its manifest
    (root / "latest.json").unlink()  # no pointer: the newest committed one is gen-2
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and f"{GEN2}: OK" in out and f"{GEN3}: INVALID" in out
    assert f"{GEN3}: newer than {GEN2} and invalid" in out and "--newest-valid" in out
    code, out, err = run(capsys, "verify", str(root), "--newest-valid")
    assert code == 0 and f"{GEN2}: OK" in out and GEN3 in err
    code, out, _ = run(capsys, "verify", str(root), "--json")
    data = json.loads(out)
    assert (data["generation"], data["ok"], data["all_ok"]) == (GEN2, True, False)
    assert [(r["generation"], r["ok"]) for r in data["newer"]] == [(GEN3, False)]
    # a newer directory without a manifest (a save in flight) is not committed-looking
    os.remove(root / GEN3 / "manifest.json")
    assert run(capsys, "verify", str(root))[0] == 0


def test_verify_root_checks_a_valid_newer_generation_too(root: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    point_latest_at(root, GEN2)
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and f"{GEN3}: OK" in out and f"{GEN2}: OK" in out


def test_verify_options_exclude_each_other(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--all", "--newest-valid"], [GEN1, "--newest-valid"], [GEN1, "--all"]):
        code, out, err = run(capsys, "verify", str(root), *argv)
        assert code == 2 and out == "" and "one of GEN, --all and --newest-valid" in err


def test_diff_root_refuses_a_broken_newest_generation(root: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "diff", str(root), str(root))[0] == 0
    (root / GEN3 / SHARD).write_bytes(b"short")
    (root / "latest.json").unlink()
    code, out, err = run(capsys, "diff", str(root), str(root / GEN2))
    assert code == 1 and out == "" and f"the newest generation {GEN3} is invalid" in err
    assert f"{root}/{GEN2}" in err  # how to name an older one
    # named explicitly, the older generation is compared
    assert run(capsys, "diff", str(root / GEN2), str(root / GEN2))[0] == 0


def test_diff_root_takes_a_valid_generation_newer_than_latest(root: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    point_latest_at(root, GEN2)
    code, out, _ = run(capsys, "diff", str(root), str(root / GEN3))
    assert code == 0 and "identical" in out and out.count(GEN3) == 2


# ---- item 14: short generation names ---------------------------------------------------
@pytest.mark.parametrize("name", ["2", "gen-2", "gen-02", GEN2])
def test_short_generation_names(root: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, out, _ = run(capsys, "inspect", str(root), name, "--json")
    assert code == 0 and json.loads(out)["generation"] == GEN2
    code, out, _ = run(capsys, "verify", str(root), name)
    assert code == 0 and out.startswith(f"{GEN2}: OK")
    code, out, _ = run(capsys, "pin", str(root), name, "--label", "best")
    assert code == 0 and f"pinned {GEN2} as best" in out
    code, out, _ = run(capsys, "unpin", str(root), name)
    assert code == 0 and f"unpinned {GEN2}" in out
    code, out, _ = run(capsys, "quarantine", str(root), name)
    assert code == 0 and out.startswith(f"moved {GEN2} aside")


@pytest.mark.parametrize("name", ["-2", "gen-", "1234567890123", "gen-1234567890123", "2/../3",
                                  "./2", "gen-2x"])
def test_short_names_are_names_never_paths(root: Path, capsys: pytest.CaptureFixture[str],
                                           name: str) -> None:
    code, out, err = run(capsys, "inspect", str(root), name)
    assert code == 2 and out == "" and err.startswith("dist-ckpt: error:")


def test_short_name_of_a_missing_generation(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", str(root), "99")
    assert code == 2 and "no generation gen-000000000099 under" in err


# ---- item 11: prune with nothing to remove says so --------------------------------------
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_prune_with_nothing_to_remove(root: Path, capsys: pytest.CaptureFixture[str],
                                      dry_run: list[str]) -> None:
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "3", *dry_run)
    assert (code, out) == (0, "nothing to prune: 3 generation(s) kept (--keep-last 3)\n")
    assert run(capsys, "pin", str(root), GEN1)[0] == 0
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--keep-every", "2", *dry_run)
    assert (code, out) == (0, "nothing to prune: 3 generation(s) kept "
                              "(--keep-last 1, --keep-every 2 milestones, 1 pinned)\n")
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "3", "--json", *dry_run)
    assert code == 0 and json.loads(out)["kept"] == 3 and json.loads(out)["generations"] == []


def test_prune_that_removes_does_not_say_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "2", "--dry-run")
    assert code == 0 and out == f"would remove generation: {GEN1}\n"


# ---- item 12: quarantine says its result once -------------------------------------------
def test_quarantine_prints_its_result_once(root: Path, capsys: pytest.CaptureFixture[str],
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        code, out, err = run(capsys, "quarantine", str(root), GEN1)
    assert code == 0 and out.count("aside") == 1 and out.startswith(f"moved {GEN1} aside to ")
    assert err == "" and not [r for r in caplog.records if "aside" in r.getMessage()]
    assert logging.getLogger("dist_ckpt").level == logging.NOTSET  # the library's level is back


# ---- item 10: rm, quarantine and a restore's move-aside repoint latest.json ----------------
def latest_of(root: Path) -> str | None:
    path = root / "latest.json"
    return json.loads(path.read_text())["generation"] if path.exists() else None


def test_rm_repoints_latest_at_the_newest_valid(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(root / GEN3 / SHARD)
    flip_byte(root / GEN2 / SHARD)  # not valid either: the pointer skips it
    code, out, _ = run(capsys, "rm", str(root), "3", "--invalid-only")
    assert code == 0 and f"{GEN3} now names" not in out
    assert f"latest.json now names {GEN1} (it named {GEN3})" in out and latest_of(root) == GEN1
    code, _, err = run(capsys, "ls", str(root))
    assert code == 0 and "points to" not in err
    # an rm of what latest.json does not name leaves it alone
    code, out, _ = run(capsys, "rm", str(root), GEN2, "--invalid-only", "--json")
    assert code == 0 and json.loads(out)["latest"] is None and latest_of(root) == GEN1


def test_rm_of_the_last_valid_removes_the_pointer(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in (GEN1, GEN2, GEN3):
        flip_byte(root / name / SHARD)
    code, out, _ = run(capsys, "rm", str(root), GEN3, "--invalid-only", "--json")
    assert code == 0 and json.loads(out)["latest"] == {"was": GEN3, "now": None}
    assert latest_of(root) is None
    code, _, err = run(capsys, "ls", str(root))
    assert code == 0 and "points to" not in err


def test_quarantine_of_latest_repoints_it(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "quarantine", str(root), GEN3, "--force")
    assert code == 0 and f"latest.json now names {GEN2} (it named {GEN3})" in out
    assert latest_of(root) == GEN2
    code, out, _ = run(capsys, "quarantine", str(root), GEN1)  # not the latest: left alone
    assert code == 0 and "latest.json" not in out and latest_of(root) == GEN2


def test_restore_move_aside_repoints_latest(root: Path) -> None:
    from dist_ckpt import CheckpointConfig, CheckpointManager

    (root / GEN3 / SHARD).write_bytes(b"short")
    with CheckpointManager(CheckpointConfig(root=str(root)), make_state()) as mgr:
        result = mgr.restore()
    assert result.next_update == 2 and not (root / GEN3).exists()
    assert latest_of(root) == GEN2


# ---- item 13: export's directory mode, index rule and source root -------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_takes_the_umask_and_records_an_absolute_root(root: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str],
                                                             umask: int) -> None:
    monkeypatch.chdir(root.parent)
    old = os.umask(umask)
    try:
        code, out, _ = run(capsys, "export", root.name, "2", "--out", "release")
    finally:
        os.umask(old)
    out_dir = root.parent / "release"
    assert code == 0 and f"exported {GEN2} to {out_dir}" in out
    assert out_dir.stat().st_mode & 0o777 == 0o777 & ~umask
    for name in os.listdir(out_dir):
        assert (out_dir / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    release = json.loads((out_dir / "release.json").read_text())
    assert release["source_root"] == str(root) and release["generation"] == GEN2
    # one rule: the index comes with every export, one shard or several
    assert sorted(os.listdir(out_dir)) == ["model.safetensors", "model.safetensors.index.json",
                                           "release.json"]
    assert [n for n in os.listdir(root.parent) if ".tmp-" in n] == []


# ---- item 8: ls LAUNCHROOT lists the runs ---------------------------------------------------
@pytest.fixture
def launch_root(template: Path, tmp_path: Path) -> Path:
    """A launcher root: run 0001 (three generations, no DONE), run 0002 (finished), an empty
    run 0003, and ``current`` naming 0002. The layout's names come from launcher_api."""
    from dist_ckpt import CheckpointConfig, CheckpointManager
    from dist_ckpt.launcher_api import CURRENT_NAME, run_root

    top = tmp_path / "launch"
    shutil.copytree(template, run_root(str(top), "0001"))
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=run_root(str(top), "0002")), state) as mgr:
        step(state)
        mgr.finish(4, tokens_seen=40)
    os.makedirs(run_root(str(top), "0003"))
    (top / CURRENT_NAME).write_text("0002\n")
    return top


def test_ls_of_a_launcher_root_lists_its_runs(launch_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dist_ckpt.launcher_api import run_root

    code, out, err = run(capsys, "ls", str(launch_root))
    assert code == 0 and err == "" and "no generations" not in out
    lines = out.splitlines()
    assert lines[0] == f"launcher root {launch_root}: 3 run(s) under runs/"
    row = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in lines[2:5]}
    assert "3" in row["0001"].split() and GEN3 in row["0001"] and row["0001"].rstrip().endswith("not done")
    assert row["0002"].startswith("*") and "gen-000000000004" in row["0002"]
    assert row["0002"].rstrip().endswith("DONE (gen-000000000004)")
    assert "(none)" in row["0003"]
    assert f"list one run's generations: dist-ckpt ls {run_root(str(launch_root), '0002')}" in out
    code, out, _ = run(capsys, "ls", str(launch_root), "--json")
    data = json.loads(out)
    assert code == 0 and data["generations"] == []
    runs = {r["run_id"]: r for r in data["launcher_runs"]}
    assert (runs["0001"]["newest"], runs["0001"]["done"], runs["0001"]["generations"]) == (GEN3, False, 3)
    assert (runs["0002"]["done_generation"], runs["0002"]["active"]) == ("gen-000000000004", True)
    # the run's own listing, as the hint says
    code, out, _ = run(capsys, "ls", run_root(str(launch_root), "0001"))
    assert code == 0 and GEN3 in out and "launcher root" not in out


def test_ls_of_a_plain_root_has_no_runs(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 0 and "launcher_runs" not in json.loads(out)


# ---- item 9: a rehearsal that ran no update fails -------------------------------------------
def test_rehearsal_without_an_update_fails(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from dist_ckpt.cli.rehearse import report

    record = {"passed": True, "loss": None, "digest": "ab" * 32, "updates": 0, "time_unix": 1.0}
    code = report(argparse.Namespace(json=False), 0, {GEN3: record})
    out = capsys.readouterr().out
    assert code == 1 and out.startswith(f"{GEN3}: rehearsal ran NO update: the script saved at update 3")
    assert "passed" not in out
    code = report(argparse.Namespace(json=True), 0, {GEN3: record})
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["problem"] == "no update ran" and data["updates"] == 0
    code = report(argparse.Namespace(json=False), 0, {GEN3: {**record, "updates": 1}})
    assert code == 0 and "rehearsal passed; state digest after 1 update(s)" in capsys.readouterr().out


def test_verify_root_with_a_pointer_at_a_missing_generation(root: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(root / GEN3)  # deleted by hand: the pointer names nothing
    code, out, err = run(capsys, "verify", str(root))
    assert code == 0 and out.startswith(f"{GEN2}: OK") and f"latest.json points to {GEN3}" in err
