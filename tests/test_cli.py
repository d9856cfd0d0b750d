"""The ``dist-ckpt`` command line over real generations written by the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.cli.app import human_bytes
from tests.helpers.cli_runs import flip_byte, private_copy, run

GEN10 = "gen-000000000010"
GEN20 = "gen-000000000020"
DCP_FILE = "dcp/__0_0.distcp"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = CheckpointManager(CheckpointConfig(root=str(root)), TrainState(model, opt))
    mgr.save(10)
    mgr.save(20)
    mgr.close()
    return root


@pytest.fixture
def root(template: Path, tmp_path: Path) -> Path:
    """A private copy of the two-generation root, free to corrupt."""
    return private_copy(template, tmp_path)




def test_ls_lists_committed_newest_first(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    lines = [line for line in out.splitlines() if "gen-" in line and "latest.json" not in line]
    assert GEN20 in lines[0] and GEN10 in lines[1]
    assert all("committed" in line for line in lines)
    assert lines[0].startswith("*") and not lines[1].startswith("*")

    code, out, _ = run(capsys, "ls", str(root), "--json")
    data = json.loads(out)
    assert code == 0 and data["latest"] == GEN20
    assert [g["name"] for g in data["generations"]] == [GEN20, GEN10]
    assert [g["state"] for g in data["generations"]] == ["committed", "committed"]
    assert data["generations"][0]["latest"] is True
    assert data["generations"][0]["total_bytes"] > 0


def test_ls_shows_pending(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / ".pending-gen-000000000030-abcd").mkdir()
    code, out, _ = run(capsys, "ls", str(root), "--json")
    gens = {g["name"]: g for g in json.loads(out)["generations"]}
    assert code == 0
    assert gens[".pending-gen-000000000030-abcd"]["state"] == "pending"
    assert gens[".pending-gen-000000000030-abcd"]["next_update"] == 30
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    assert any(".pending-gen-000000000030-abcd" in line and "pending" in line
               for line in out.splitlines())


def test_inspect_defaults_to_newest_committed(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", str(root))
    assert code == 0
    assert GEN20 in out and "next_update        20" in out
    assert "model" in out and "contract_digest" in out and "world_size         1" in out

    code, out, _ = run(capsys, "inspect", str(root), GEN10, "--json")
    assert code == 0
    manifest = json.loads(out)
    assert manifest["generation"] == GEN10 and manifest["next_update"] == 10


def test_inspect_skips_invalid_newest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / GEN20 / DCP_FILE).write_bytes(b"short")
    code, out, _ = run(capsys, "inspect", str(root))
    assert code == 0 and GEN10 in out and GEN20 not in out


def test_verify_ok(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0 and GEN20 in out and "OK" in out
    code, out, _ = run(capsys, "verify", str(root), GEN10, "--json")
    result = json.loads(out)
    assert code == 0
    assert (result["generation"], result["ok"], result["path"]) == (GEN10, True, None)


def test_verify_detects_bit_flip(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flip_byte(root / GEN20 / DCP_FILE)
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and DCP_FILE in out and "blake3" in out
    code, out, _ = run(capsys, "verify", str(root), GEN20, "--json")
    result = json.loads(out)
    assert code == 1
    assert result["ok"] is False and result["path"] == DCP_FILE and result["generation"] == GEN20
    # the older generation is untouched
    assert run(capsys, "verify", str(root), GEN10)[0] == 0


def test_verify_detects_truncation(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = root / GEN20 / DCP_FILE
    path.write_bytes(path.read_bytes()[:-10])
    code, out, _ = run(capsys, "verify", str(root), GEN20)
    assert code == 1 and DCP_FILE in out and "bytes" in out
    # the default is what latest.json names: the broken newest fails the check
    code, out, err = run(capsys, "verify", str(root))
    assert code == 1 and f"{GEN20}: INVALID" in out and GEN10 not in out
    # --newest-valid is inspect's default: the newest committed one, with a note naming what it skipped
    code, out, err = run(capsys, "verify", str(root), "--newest-valid")
    assert code == 0 and GEN10 in out and GEN20 in err
    code, out, _ = run(capsys, "ls", str(root), "--json")
    states = {g["name"]: g["state"] for g in json.loads(out)["generations"]}
    assert states == {GEN20: "invalid", GEN10: "committed"}


def test_corrupt_manifest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (root / GEN20 / "manifest.json").write_bytes(b"\x00garbage{{")
    code, out, err = run(capsys, "verify", str(root), GEN20, "--json")
    result = json.loads(out)
    assert code == 1 and result["ok"] is False and result["path"] == "manifest.json"
    code, out, err = run(capsys, "verify", str(root), GEN20)
    assert code == 1 and "corrupt" in out and "Traceback" not in out + err

    code, out, _ = run(capsys, "ls", str(root))
    line = next(line for line in out.splitlines() if GEN20 in line and "latest.json" not in line)
    assert code == 0 and "invalid" in line and "corrupt" in line

    code, out, err = run(capsys, "inspect", str(root), GEN20)
    assert code == 1 and err.startswith("dist-ckpt: error:") and "corrupt" in err
    code, out, _ = run(capsys, "inspect", str(root))  # default falls back to a committed one
    assert code == 0 and GEN10 in out


def test_missing_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope")
    for command in ("ls", "inspect", "verify"):
        code, out, err = run(capsys, command, missing)
        assert code == 2 and out == ""
        assert err.startswith("dist-ckpt: error:") and "does not exist" in err


def test_root_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    code, _, err = run(capsys, "ls", str(path))
    assert code == 2 and err.startswith("dist-ckpt: error:")


@pytest.mark.parametrize("name", ["../x", "/etc", "gen-1/../..", "..", "gen-1", "latest.json",
                                  "gen-000000000020/../gen-000000000010"])
def test_unsafe_generation_names(root: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    for command in ("inspect", "verify"):
        code, out, err = run(capsys, command, str(root), name)
        assert code == 2 and out == ""
        assert err.startswith("dist-ckpt: error:") and "Traceback" not in err


def test_unknown_generation(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("inspect", "verify"):
        code, _, err = run(capsys, command, str(root), "gen-000000000099")
        assert code == 2 and "no generation" in err


def test_missing_object_store_root(s3_endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", "s3://no-such-bucket-here/run")
    assert code == 2 and err.startswith("dist-ckpt: error:") and "s3://no-such-bucket-here/run" in err


def test_empty_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "no generations" in out
    assert run(capsys, "verify", str(tmp_path))[0] == 2
    assert run(capsys, "inspect", str(tmp_path))[0] == 2


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys)[0] == 2
    assert run(capsys, "frobnicate")[0] == 2


def test_human_bytes() -> None:
    assert human_bytes(None) == "-"
    assert human_bytes(512) == "512 B"
    assert human_bytes(35455) == "34.6 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"


@pytest.mark.processes
def test_module_entry_point(root: Path) -> None:
    """``python -m dist_ckpt.cli``: its exit status and report as a process (one interpreter:
    the in-process tests above cover each verdict)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    flip_byte(root / GEN20 / DCP_FILE)
    bad = subprocess.run([sys.executable, "-m", "dist_ckpt.cli", "verify", str(root)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and DCP_FILE in bad.stdout and "Traceback" not in bad.stderr
    assert GEN20 in bad.stdout
