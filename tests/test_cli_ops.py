"""``dist-ckpt`` operations on real generations: quarantine, rm, pins, warnings, defaults."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, ResumableSampler, __version__
from dist_ckpt.cli.app import FOOTNOTE
from dist_ckpt.format.inventory import is_committed
from dist_ckpt.format.manifest import MANIFEST_NAME, REASON_NAME, REJECTED_DIR
from dist_ckpt.format.validate import Problem
from dist_ckpt.lifecycle.retention import change_pin, read_pins, set_pin
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.tiers.rejected import move_aside
from tests.helpers.cli_runs import flip_byte, run, two_generation_roots
from tests.helpers.local_jobs import make_state, step
from tests.helpers.roots import make_two_gen_root

GEN1 = "gen-000000000001"
GEN2 = "gen-000000000002"
SHARD = "dcp/__0_0.distcp"


# root: a private copy of gen-1 and gen-2 (latest.json -> gen-2), free to damage
template, root = two_generation_roots("ops-template")


def test_is_committed(root: Path) -> None:
    """The one answer to "is G committed here?": manifest, structure and sizes (no digests)."""
    store = LocalStore(str(root))
    assert is_committed(store, GEN1) and is_committed(store, GEN2)
    assert not is_committed(store, "gen-000000000003")
    (root / GEN2 / SHARD).write_bytes(b"x")  # the wrong size
    (root / GEN1 / MANIFEST_NAME).unlink()
    assert not is_committed(store, GEN2) and not is_committed(store, GEN1)


@pytest.fixture(scope="module")
def sampler_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generation whose train state holds a sampler position and extras."""
    root = tmp_path_factory.mktemp("ops-sampler")
    state = make_state()
    state.sampler = ResumableSampler(100, 4, rank=0, world_size=1, seed=7)
    state.extras.update({"best_loss": 0.25, "tracker_run": "abc"})
    with CheckpointManager(CheckpointConfig(root=str(root)), state) as mgr:
        for _ in range(3):
            state.sampler.next_batch()
        step(state)
        mgr.save(1)
    return root



def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])



def entries(root: Path) -> list[str]:
    rejected = root / REJECTED_DIR
    return sorted(os.listdir(rejected)) if rejected.exists() else []


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---- 1. ls shows quarantined generations ---------------------------------------------------
def test_ls_shows_quarantined_generations(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    moved = move_aside(str(root), Problem(GEN1, "shard damaged\nsecond line", SHARD))
    assert moved is not None
    entry = os.path.basename(moved)
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    row = next(line for line in out.splitlines() if "quarantined" in line)
    assert f"{REJECTED_DIR}/{entry}" in row and "shard damaged" in row and "second line" not in out
    assert any(GEN2 in line and "committed" in line for line in out.splitlines())

    code, out, _ = run(capsys, "ls", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and [g["name"] for g in data["generations"]] == [GEN2]
    [rec] = data["quarantined"]
    assert (rec["name"], rec["generation"], rec["state"], rec["path"]) == (
        entry, GEN1, "quarantined", f"{REJECTED_DIR}/{entry}")
    assert rec["reason"] == f"{GEN1} ({SHARD}): shard damaged" and rec["next_update"] == 1


def test_ls_without_quarantine_lists_none(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "ls", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and data["quarantined"] == [] and data["warnings"] == [] and err == ""


# ---- 2. quarantine ------------------------------------------------------------------------
def test_quarantine_refuses_valid_latest_unless_forced(root: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "quarantine", str(root), GEN2)
    assert code == 1 and out == "" and "latest.json points to" in err and "--force" in err
    assert (root / GEN2).is_dir() and entries(root) == []

    code, out, _ = run(capsys, "quarantine", str(root), GEN2, "--force", "--reason", "loss diverged")
    [entry] = entries(root)
    assert code == 0 and out.startswith(f"moved {GEN2} aside to ") and entry in out
    assert entry.startswith(f"{GEN2}-") and not (root / GEN2).exists()
    assert "loss diverged" in (root / REJECTED_DIR / entry / REASON_NAME).read_text()
    assert (root / REJECTED_DIR / entry / SHARD).exists()  # moved, never deleted


def test_quarantine_moves_an_older_valid_generation(root: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "quarantine", str(root), GEN1, "--json")
    result = json.loads(out)
    assert code == 0 and result["generation"] == GEN1 and result["unpinned"] is None
    assert os.path.dirname(result["path"]) == str(root / REJECTED_DIR)
    assert "operator" in (Path(result["path"]) / REASON_NAME).read_text()


def test_quarantine_refuses_pinned_unless_forced(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "pin", str(root), GEN1, "--label", "best")[0] == 0
    code, _, err = run(capsys, "quarantine", str(root), GEN1)
    assert code == 1 and "pinned as best" in err and (root / GEN1).is_dir()
    code, out, _ = run(capsys, "quarantine", str(root), GEN1, "--force")
    assert code == 0 and f"unpinned {GEN1} (was best)" in out
    assert read_pins(LocalStore(str(root))) == {} and not (root / GEN1).exists()


def test_quarantine_takes_a_damaged_latest_without_force(root: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(root / GEN2 / SHARD)  # sizes still match: only the digest check finds it
    code, out, _ = run(capsys, "quarantine", str(root), GEN2)
    [entry] = entries(root)
    assert code == 0 and entry in out
    reason = (root / REJECTED_DIR / entry / REASON_NAME).read_text()
    assert SHARD in reason and "blake3" in reason


@pytest.mark.parametrize("argv, message", [
    (["ROOT", "gen-000000000099"], "no generation"),
    (["ROOT", "../gen-000000000001"], "unsafe"),
])
def test_quarantine_usage_errors(root: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                 message: str) -> None:
    argv = [str(root) if arg == "ROOT" else arg for arg in argv]
    code, out, err = run(capsys, "quarantine", *argv)
    assert code == 2 and out == "" and message in err and entries(root) == []


# ---- 3. rm --invalid-only -----------------------------------------------------------------
def test_rm_requires_invalid_only(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(root / GEN2 / SHARD)
    code, out, err = run(capsys, "rm", str(root), GEN2)
    assert code == 2 and out == "" and "--invalid-only" in err and (root / GEN2).is_dir()


def test_rm_leaves_a_valid_generation(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "rm", str(root), GEN1, "--invalid-only")
    assert code == 1 and out == "" and f"{GEN1} is valid" in err and "not deleted" in err
    assert (root / GEN1 / "manifest.json").exists()


@pytest.mark.parametrize("damage", [truncate, flip_byte])
def test_rm_deletes_an_invalid_generation(root: Path, capsys: pytest.CaptureFixture[str], damage) -> None:
    damage(root / GEN2 / SHARD)
    code, out, _ = run(capsys, "rm", str(root), GEN2, "--invalid-only")
    assert code == 0 and out.startswith(f"deleted {GEN2}") and SHARD in out
    assert not (root / GEN2).exists() and (root / GEN1).is_dir()


def test_rm_unpins_what_it_deletes(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "pin", str(root), GEN2)[0] == 0
    truncate(root / GEN2 / SHARD)
    code, out, _ = run(capsys, "rm", str(root), GEN2, "--invalid-only", "--json")
    result = json.loads(out)
    assert code == 0 and result["deleted"] == GEN2 and result["unpinned"] == "pinned"
    assert read_pins(LocalStore(str(root))) == {}


def test_rm_quarantined_entries(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(root / GEN2 / SHARD)
    damaged = os.path.basename(move_aside(str(root), Problem(GEN2, "truncated shard")) or "")
    valid = os.path.basename(move_aside(str(root), Problem(GEN1, "operator")) or "")
    code, _, err = run(capsys, "rm", str(root), f"{REJECTED_DIR}/{valid}", "--invalid-only")
    assert code == 1 and "is valid" in err and (root / REJECTED_DIR / valid).is_dir()
    code, out, _ = run(capsys, "rm", str(root), damaged, "--invalid-only")
    assert code == 0 and f"deleted {REJECTED_DIR}/{damaged}" in out
    assert entries(root) == [valid]


@pytest.mark.parametrize("name, message", [
    (f"{REJECTED_DIR}/../{GEN1}", "neither a generation name nor a quarantined entry"),
    (f"{GEN1}-20260101T000000Z-abcdef", "no quarantined entry"),
    ("gen-000000000099", "no generation"),
    ("latest.json", "neither"),
])
def test_rm_usage_errors(root: Path, capsys: pytest.CaptureFixture[str], name: str, message: str) -> None:
    code, out, err = run(capsys, "rm", str(root), name, "--invalid-only")
    assert code == 2 and out == "" and message in err
    assert (root / GEN1).is_dir() and (root / GEN2).is_dir()


def test_quarantine_ls_and_rm_on_an_object_store(s3_endpoint: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """quarantine, the quarantined rows of ls, and rm --invalid-only on an s3:// root."""
    root = make_two_gen_root("s3", "")
    url = root.url
    root.damage(GEN2, SHARD, "bitflip")  # a damaged latest goes without --force
    code, out, _ = run(capsys, "quarantine", url, GEN2, "--json")
    result = json.loads(out)
    [entry] = root.rejected_entries()
    assert code == 0 and result["path"] == f"{url}/{REJECTED_DIR}/{entry}"
    assert result["latest"] == {"was": GEN2, "now": GEN1}
    assert not root.store.exists(f"{GEN2}/{MANIFEST_NAME}")

    code, out, _ = run(capsys, "ls", url, "--json")
    data = json.loads(out)
    assert code == 0 and [g["name"] for g in data["generations"]] == [GEN1]
    [rec] = data["quarantined"]
    assert (rec["name"], rec["generation"], rec["path"]) == (entry, GEN2, f"{REJECTED_DIR}/{entry}")
    assert SHARD in rec["reason"] and rec["total_bytes"] > 0

    code, out, _ = run(capsys, "rm", url, f"{REJECTED_DIR}/{entry}", "--invalid-only")
    assert code == 0 and f"deleted {REJECTED_DIR}/{entry}" in out and root.rejected_entries() == []


# ---- 4. latest.json naming a missing generation -------------------------------------------
def test_missing_latest_warns(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(root / GEN2)
    code, out, err = run(capsys, "ls", str(root))
    assert code == 0 and "warning" in err and GEN2 in err and GEN1 in out
    code, out, _ = run(capsys, "ls", str(root), "--json")
    [warning] = json.loads(out)["warnings"]
    assert code == 0 and GEN2 in warning and "does not exist" in warning
    code, out, err = run(capsys, "inspect", str(root))
    assert code == 0 and GEN1 in out and "warning" in err and GEN2 in err
    code, out, _ = run(capsys, "inspect", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and data["generation"] == GEN1 and GEN2 in data["warnings"][0]


# ---- 5. pin / unpin -----------------------------------------------------------------------
def test_pin_refuses_invalid_generations(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truncate(root / GEN2 / SHARD)
    code, out, err = run(capsys, "pin", str(root), GEN2)
    assert code == 1 and out == "" and f"cannot pin {GEN2}" in err and "bytes" in err
    (root / "gen-000000000003").mkdir()  # never committed: no manifest
    code, _, err = run(capsys, "pin", str(root), "gen-000000000003")
    assert code == 1 and "never committed" in err
    assert read_pins(LocalStore(str(root))) == {}


def test_unpin_of_unpinned_generation(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "unpin", str(root), GEN1)
    assert code == 1 and out == "" and f"{GEN1} is not pinned" in err
    assert not (root / "pins.json").exists()


def test_repin_with_another_label(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "pin", str(root), GEN1, "--label", "best")
    assert code == 0 and f"pinned {GEN1} as best" in out
    code, out, _ = run(capsys, "pin", str(root), GEN1, "--label", "final")
    assert code == 0 and f"{GEN1} was pinned as best, now final" in out
    code, out, _ = run(capsys, "pin", str(root), GEN1, "--label", "release", "--json")
    result = json.loads(out)
    assert code == 0 and result["message"] == f"{GEN1} was pinned as final, now release"
    assert (result["previous"], result["label"], result["pins"]) == ("final", "release", {GEN1: "release"})
    code, out, _ = run(capsys, "unpin", str(root), GEN1)
    assert code == 0 and f"unpinned {GEN1} (was release)" in out


def test_retention_pin_functions(root: Path) -> None:
    backend = LocalStore(str(root))
    assert set_pin(backend, GEN1, "best") == {GEN1: "best"}  # CheckpointManager.pin's contract
    change = change_pin(backend, GEN1, "final")
    assert (change.pins, change.previous) == ({GEN1: "final"}, "best")
    assert change_pin(backend, GEN2, None).previous is None  # unpinning the unpinned: a no-op
    assert set_pin(backend, GEN1, None) == {}


# ---- 6. --version, verify --all, shared default, inspect details --------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"dist-ckpt {__version__}\n"


def test_verify_all(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True
    assert [(r["generation"], r["ok"]) for r in data["generations"]] == [(GEN2, True), (GEN1, True)]
    flip_byte(root / GEN1 / SHARD)
    code, out, _ = run(capsys, "verify", str(root), "--all", "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert [(r["generation"], r["ok"]) for r in data["generations"]] == [(GEN2, True), (GEN1, False)]
    code, out, _ = run(capsys, "verify", str(root), "--all")
    assert code == 1 and f"{GEN2}: OK" in out and f"{GEN1}: INVALID" in out and "1 of 2" in out
    assert run(capsys, "verify", str(root), GEN1, "--all")[0] == 2


def test_inspect_and_verify_newest_valid_share_the_default(root: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    truncate(root / GEN2 / SHARD)  # newest invalid: both take the newest committed one
    code, out, err = run(capsys, "inspect", str(root), "--json")
    assert code == 0 and json.loads(out)["generation"] == GEN1 and GEN2 in err
    code, out, err = run(capsys, "verify", str(root), "--newest-valid", "--json")
    assert code == 0 and json.loads(out)["generation"] == GEN1 and GEN2 in err
    # without --newest-valid, verify takes what latest.json names and fails on it
    code, out, err = run(capsys, "verify", str(root), "--json")
    assert code == 1 and json.loads(out)["generation"] == GEN2
    truncate(root / GEN1 / SHARD)  # none committed: both take the newest of any state
    code, out, _ = run(capsys, "inspect", str(root), "--json")
    assert code == 0 and json.loads(out)["generation"] == GEN2
    code, out, _ = run(capsys, "verify", str(root), "--newest-valid", "--json")
    assert code == 1 and json.loads(out)["generation"] == GEN2
    code, out, _ = run(capsys, "verify", str(root), "--json")
    assert code == 1 and json.loads(out)["generation"] == GEN2


def test_inspect_shows_data_position_extras_pin_and_tier(sampler_root: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(sampler_root, root)
    assert run(capsys, "pin", str(root), GEN1, "--label", "best")[0] == 0
    code, out, _ = run(capsys, "inspect", str(root))
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in out.splitlines()}
    assert code == 0 and "cursor=12" in fields["data_position"] and "seed=7" in fields["data_position"]
    assert fields["extras"] == "best_loss, tracker_run"
    assert (fields["pin"], fields["tier"]) == ("best", "local")
    code, out, _ = run(capsys, "inspect", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and data["data_position"]["cursor"] == 12 and data["data_position"]["epoch"] == 0
    assert data["extras_keys"] == ["best_loss", "tracker_run"] and data["pin"] == "best"
    assert data["tier"]["name"] == "local" and data["tier"]["mirror"] is None
    assert data["state_error"] is None and data["warnings"] == []


def test_inspect_tier_from_mirror_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / "mirror.json").write_text(json.dumps(
        {"mirror": "s3://bucket/run", "last_completed": GEN2, "skipped": [GEN1]}))
    code, out, _ = run(capsys, "inspect", str(root), GEN2)
    assert code == 0 and "last completed upload" in out and "s3://bucket/run" in out
    code, out, _ = run(capsys, "inspect", str(root), GEN1, "--json")
    tier = json.loads(out)["tier"]
    assert code == 0 and (tier["mirror"], tier["mirror_record"]) == ("s3://bucket/run", "skipped")


def test_inspect_checks_the_state_file_digest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_file = root / GEN2 / "state" / "train_state.json"
    state_file.write_bytes(state_file.read_bytes().replace(b"next_update", b"next_updatX", 1))
    code, out, err = run(capsys, "inspect", str(root), GEN2)
    assert code == 1 and "next_update        2" in out  # the manifest is still shown
    assert "train_state.json does not match its manifest entry" in err
    code, out, _ = run(capsys, "inspect", str(root), GEN2, "--json")
    data = json.loads(out)
    assert code == 1 and "does not match" in data["state_error"] and data["data_position"] is None


# ---- 7. ls footnote -----------------------------------------------------------------------
def test_ls_ends_with_the_footnote(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and out.splitlines()[-1] == FOOTNOTE
    assert "verify" in FOOTNOTE and "sizes" in FOOTNOTE


# ---- 8. prune without --keep-last ---------------------------------------------------------
def test_prune_local_without_keep_last(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "prune", str(root), "--dry-run")
    assert code == 2 and out == "" and "--keep-last K" in err and "--keep-last 3" in err
    assert (root / GEN1).is_dir() and (root / GEN2).is_dir()
    code, out, _ = run(capsys, "prune", "--help")
    assert code == 0 and "required for a local root" in one_line(out)
