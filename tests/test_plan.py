"""Cadence planning: the model in ``dist_ckpt.save.cadence``, the cost estimate in
``dist_ckpt.cli.costs`` and the ``dist-ckpt plan`` command."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from dist_ckpt.cli.app import main
from dist_ckpt.cli.costs import GB, MONTH_S, estimate_costs, parse_duration
from dist_ckpt.format.manifest import (
    FORMAT_VERSION,
    GLOBAL_STATE_FILE,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    generation_name,
    rank_state_file,
)
from dist_ckpt.save.cadence import interval_updates, lost_fraction, t_star
from dist_ckpt.version import __version__

T_STAR_10_4H = math.sqrt(2 * 10 * 14400)  # 536.656...


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run(capsys, "plan", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def write_generation(root: Path, update: int, *, save_s: float, payload: int) -> Manifest:
    """A committed single-rank generation: the files check_structure requires, listed with their
    real sizes (inventory without digests checks presence and sizes)."""
    name = generation_name(update)
    contents = {"dcp/.metadata": b"m" * 10, "dcp/__0_0.distcp": b"x" * payload,
                GLOBAL_STATE_FILE: b"{}", rank_state_file(0): b"{}"}
    entries = []
    for rel, data in contents.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entries.append(FileEntry(path=rel, size=len(data), sha256=hashlib.sha256(data).hexdigest(), rank=0))
    manifest = Manifest(
        format_version=FORMAT_VERSION, generation=name, next_update=update, tokens_seen=0, world_size=1,
        components=[], contract={}, contract_digest="", torch_version=torch.__version__,
        dist_ckpt_version=__version__, created_unix=1.7e9 + update, save_duration_s=save_s,
        total_bytes=sum(e.size for e in entries), files=entries)
    (root / name / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    return manifest


@pytest.fixture
def empty_root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    return root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Three committed generations whose saves took 30, 4 and 10 s (median 10), the newest the
    largest; plus one uncommitted directory that must not count."""
    root = tmp_path / "ckpt"
    write_generation(root, 10, save_s=30.0, payload=100)
    write_generation(root, 20, save_s=4.0, payload=100)
    write_generation(root, 30, save_s=10.0, payload=5000)
    (root / ".pending-gen-000000000040-abcd").mkdir()
    return root


# --- formulas ---------------------------------------------------------------------------------


def test_t_star_and_interval_updates() -> None:
    assert t_star(10, 14400) == pytest.approx(536.656, abs=1e-3)
    assert interval_updates(t_star(10, 14400), 0.8) == 671
    assert interval_updates(0.1, 5.0) == 1  # never zero updates


@pytest.mark.parametrize(("save_cost", "mtbf"), [(10, 14400), (1, 3600), (120, 86400), (0.5, 600)])
def test_lost_fraction_at_t_star_is_sqrt_2c_over_m(save_cost: float, mtbf: float) -> None:
    interval = t_star(save_cost, mtbf)
    assert lost_fraction(interval, save_cost, mtbf) == pytest.approx(math.sqrt(2 * save_cost / mtbf))
    # and T* is the minimum of the model
    assert lost_fraction(interval * 0.9, save_cost, mtbf) > lost_fraction(interval, save_cost, mtbf)
    assert lost_fraction(interval * 1.1, save_cost, mtbf) > lost_fraction(interval, save_cost, mtbf)


@pytest.mark.parametrize(("call", "name"), [
    (lambda: t_star(0, 100), "save_cost_s"), (lambda: t_star(10, -1), "mtbf_s"),
    (lambda: t_star(10, math.inf), "mtbf_s"), (lambda: interval_updates(10, 0), "step_time_s"),
    (lambda: lost_fraction(0, 1, 1), "interval_s"), (lambda: lost_fraction(1, 1, 0), "mtbf_s"),
])
def test_formulas_reject_non_positive_inputs_by_name(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize(("text", "seconds"), [
    ("10", 10.0), ("10s", 10.0), ("0.8s", 0.8), ("500ms", 0.5), ("5m", 300.0), ("4h", 14400.0),
    ("30d", 2592000.0), (" 2 h ", 7200.0), ("1e3", 1000.0),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "0", "-1", "-5s", "0ms", "abc", "5x", "4 hours", "s", ".", "nan",
                                  "inf", "1e400"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_estimate_costs_disk_and_milestones() -> None:
    estimate = estimate_costs(save_cost_s=10, mtbf_s=14400, run_length_s=8000, step_time_s=0.8,
                              generation_bytes=1000, keep_last=2, keep_every=1000)
    assert estimate.run_updates == 10000 and estimate.milestones == 10
    assert (estimate.kept_bytes, estimate.milestone_bytes, estimate.staging_bytes) == (2000, 10000, 1000)
    assert estimate.disk_bytes == 13000
    # saves every 671 updates rarely land on a multiple of 1000: the estimate says so
    assert any("lcm" in note or "671000" in note for note in estimate.notes)
    with pytest.raises(ValueError, match="keep_last"):
        estimate_costs(save_cost_s=10, mtbf_s=14400, run_length_s=8000, keep_last=0)


# --- the command -------------------------------------------------------------------------------


def test_plan_prints_t_star(empty_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", str(empty_root), "--save-cost", "10", "--mtbf", "14400")
    assert code == 0
    assert "536.7 s" in out
    assert "3.73%" in out  # sqrt(2*10/14400)
    assert "(in updates: pass --step-time)" in out and "671" not in out
    assert "pass --generation-bytes" in out  # no generation: the disk figure is unknown, not 0


def test_plan_with_step_time_gives_updates(empty_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", str(empty_root), "--save-cost", "10s", "--mtbf", "4h",
                       "--step-time", "0.8s")
    assert code == 0
    assert "536.7 s" in out and "671 updates" in out


def test_plan_json(empty_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, str(empty_root), "--save-cost", "10", "--mtbf", "14400", "--step-time", "0.8s")
    assert data["interval_s"] == pytest.approx(T_STAR_10_4H)
    assert data["interval_updates"] == 671
    assert data["lost_fraction"] == pytest.approx(math.sqrt(2 * 10 / 14400))
    assert data["run_length_s"] == 30 * 86400
    assert data["saves"] == pytest.approx(30 * 86400 / T_STAR_10_4H)
    assert data["restores"] == pytest.approx(30 * 86400 / 14400)
    assert data["sources"]["save_cost_s"] == "--save-cost"
    assert data["sources"]["mtbf_s"] == "--mtbf"
    assert data["sources"]["run_length_s"].startswith("default")
    assert data["generation_bytes"] is None and data["disk_bytes"] is None

    data = plan_json(capsys, str(empty_root), "--save-cost", "10")
    assert data["interval_updates"] is None and data["step_time_s"] is None
    assert data["mtbf_s"] == 14400 and data["sources"]["mtbf_s"] == "default 4h"
    assert "--step-time" in data["sources"]["step_time_s"]


def test_save_cost_defaults_to_median_of_manifests(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", str(root), "--mtbf", "4h")
    assert code == 0
    assert "median of 3 recorded saves" in out and "536.7 s" in out

    data = plan_json(capsys, str(root), "--mtbf", "4h", "--keep-last", "3")
    newest = json.loads((root / "gen-000000000030" / MANIFEST_NAME).read_bytes())
    assert data["save_cost_s"] == 10.0
    assert data["interval_s"] == pytest.approx(T_STAR_10_4H)
    assert data["generation_bytes"] == newest["total_bytes"] > 5000  # the newest, not the first
    assert data["files_per_generation"] == len(newest["files"]) + 1 == 5
    assert data["disk_bytes"] == (3 + 0 + 1) * newest["total_bytes"]
    assert "gen-000000000030" in data["sources"]["generation_bytes"]

    data = plan_json(capsys, str(root), "--save-cost", "2", "--generation-bytes", "2e9")
    assert data["save_cost_s"] == 2.0 and data["generation_bytes"] == 2 * 10**9


def test_no_recorded_save_cost_is_a_usage_error(empty_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", str(empty_root))
    assert code == 2 and "--save-cost" in err


def test_step_time_from_launch_log_two_levels_up(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    launch_root = tmp_path / "launch"
    root = launch_root / "runs" / "run-1"
    write_generation(root, 10, save_s=10.0, payload=10)
    lines = [
        json.dumps({"run": "run-1", "duration_s": 100.0, "updates": 100}),
        "not json at all",
        json.dumps({"duration_s": 60, "updates": 100}),
        json.dumps({"duration_s": 0, "updates": 50}),  # no time: ignored
        json.dumps({"duration_s": 30.0, "updates": 0}),  # no progress (failed at start): ignored
        json.dumps({"duration_s": 5.0, "updates": 2.5}),  # not an integer: ignored
        json.dumps({"duration_s": True, "updates": 3}),  # not a number: ignored
        json.dumps({"duration_s": "9", "updates": 3}),
        json.dumps([1, 2]),
        "",
    ]
    (launch_root / "launch-log.jsonl").write_text("\n".join(lines) + "\n")
    data = plan_json(capsys, str(root), "--mtbf", "14400")
    assert data["step_time_s"] == pytest.approx(0.8)  # 160 s / 200 updates
    assert data["interval_updates"] == 671
    assert "launch-log.jsonl" in data["sources"]["step_time_s"]
    assert "2 launch" in data["sources"]["step_time_s"]

    code, out, _ = run(capsys, "plan", str(root), "--mtbf", "14400")
    assert code == 0 and "671 updates" in out and str(launch_root) in out

    # a log in ROOT itself is preferred; --step-time overrides both
    (root / "launch-log.jsonl").write_text(json.dumps({"duration_s": 50, "updates": 100}) + "\n")
    assert plan_json(capsys, str(root), "--mtbf", "14400")["step_time_s"] == pytest.approx(0.5)
    data = plan_json(capsys, str(root), "--mtbf", "14400", "--step-time", "2s")
    assert data["step_time_s"] == 2.0 and data["sources"]["step_time_s"] == "--step-time"


def test_milestones_need_a_step_time(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = plan_json(capsys, str(root), "--keep-every", "1000", "--keep-last", "2")
    assert data["milestones"] == 0
    data = plan_json(capsys, str(root), "--keep-every", "1000", "--keep-last", "2", "--step-time", "0.8",
                     "--run-length", "8000s")
    assert data["run_updates"] == 10000 and data["milestones"] == 10
    assert data["disk_bytes"] == (2 + 10 + 1) * data["generation_bytes"]
    code, out, _ = run(capsys, "plan", str(root), "--keep-every", "1000", "--step-time", "0.8",
                       "--run-length", "8000s")
    assert code == 0 and "10 milestones" in out and "staging" in out


def write_tiers(tmp_path: Path, tiers: object) -> str:
    path = tmp_path / "tiers.json"
    path.write_text(tiers if isinstance(tiers, str) else json.dumps(tiers))
    return str(path)


def test_tiers_with_and_without_prices(root: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    tiers = write_tiers(tmp_path, {"tiers": [
        {"name": "local NVMe", "read_bytes_per_s": 2e9},
        {"name": "bucket", "read_bytes_per_s": 1000, "usd_per_gb_month": 0.02, "usd_per_1000_put": 0.005,
         "usd_per_1000_get": 0.0004}]})
    data = plan_json(capsys, str(root), "--mtbf", "4h", "--tiers", tiers, "--keep-last", "3")
    size, files = data["generation_bytes"], data["files_per_generation"]
    local, bucket = data["tiers"]
    assert local["name"] == "local NVMe" and bucket["restore_s"] == pytest.approx(size / 1000)
    assert local["storage_usd"] is None and local["total_usd"] is None
    saves, restores = 30 * 86400 / T_STAR_10_4H, 30 * 86400 / 14400
    assert bucket["put_requests"] == pytest.approx(files * saves)
    assert bucket["get_requests"] == pytest.approx(files * restores)
    gb_months = 3 * size / GB * 30 * 86400 / MONTH_S
    assert bucket["gb_months"] == pytest.approx(gb_months)
    assert bucket["storage_usd"] == pytest.approx(gb_months * 0.02)
    assert bucket["put_usd"] == pytest.approx(files * saves / 1000 * 0.005)
    assert bucket["total_usd"] == pytest.approx(bucket["storage_usd"] + bucket["put_usd"] + bucket["get_usd"])

    code, out, _ = run(capsys, "plan", str(root), "--mtbf", "4h", "--tiers", tiers)
    assert code == 0
    local_text, bucket_text = out.split("tier 'local NVMe'")[1].split("tier 'bucket'")
    assert "PUT requests" in local_text and "$" not in local_text  # no prices, no costs
    assert "restore one generation" in bucket_text and "cost over the run" in bucket_text


@pytest.mark.parametrize(("content", "problem"), [
    ("{not json", "Invalid JSON"),
    ({"tiers": []}, "tiers"),
    ([{"name": "x", "read_bytes_per_s": 1}], "object"),
    ({"tiers": [{"name": "x"}]}, "tiers[0].read_bytes_per_s"),
    ({"tiers": [{"name": "x", "read_bytes_per_s": 0}]}, "tiers[0].read_bytes_per_s"),
    ({"tiers": [{"name": "x", "read_bytes_per_s": 1, "usd_per_gb_month": -1}]}, "usd_per_gb_month"),
    ({"tiers": [{"name": "x", "read_bytes_per_s": 1, "usd_per_gb_month": "0.02"}]}, "usd_per_gb_month"),
    ({"tiers": [{"name": "x", "read_bytes_per_s": 1, "usd_per_gb_mnth": 1}]}, "usd_per_gb_mnth"),
])
def test_malformed_tiers_file_exits_2(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      content: object, problem: str) -> None:
    code, out, err = run(capsys, "plan", str(root), "--tiers", write_tiers(tmp_path, content))
    assert code == 2 and out == ""
    assert "tiers file" in err and problem in err


def test_usage_errors_exit_2(tmp_path: Path, empty_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", str(tmp_path / "missing"), "--save-cost", "10")
    assert code == 2 and "does not exist" in err
    code, _, err = run(capsys, "plan", str(empty_root), "--save-cost", "10",
                       "--tiers", str(tmp_path / "nope"))
    assert code == 2 and "cannot read tiers file" in err
    code, _, err = run(capsys, "plan", str(empty_root), "--save-cost", "10", "--mtbf", "soon")
    assert code == 2 and "invalid duration 'soon'" in err
    code, _, err = run(capsys, "plan", str(empty_root), "--save-cost", "10", "--keep-last", "0")
    assert code == 2 and "keep_last" in err


def test_without_keep_last_every_generation_is_kept_as_the_library_does(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40 item 13: one default: CheckpointConfig(keep_last=None) deletes nothing, so the
    plan counts every save of the run as kept."""
    from dist_ckpt import CheckpointConfig

    assert CheckpointConfig(root=str(root)).keep_last is None
    data = plan_json(capsys, str(root), "--mtbf", "14400", "--run-length", "8000s")
    assert data["keep_last"] == math.ceil(data["saves"]) > 3
    assert "every generation of the run" in data["sources"]["keep_last"]
    assert data["disk_bytes"] == (data["keep_last"] + 1) * data["generation_bytes"]
    assert plan_json(capsys, str(root), "--keep-last", "2")["keep_last"] == 2
