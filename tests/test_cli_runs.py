"""``dist-ckpt runs ROOT``: the launcher's runs, their starts and per-rank figures, from the
records the launcher appends (launch.records.StartRecord), here written by hand."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from dist_ckpt.cli.app import main
from dist_ckpt.launcher_api import LAUNCH_LOG_NAME, run_root
from launch.records import StartRecord, append


def started(run_id: str, start: int, kind: str, reason: str, ranks: dict | None = None) -> StartRecord:
    record = StartRecord(run_id=run_id, start=start, max_starts=3, nodes="1", procs_per_node="2",
                         world_size=2, resumed_from="fresh" if start == 1 else "gen-000000000004",
                         updates=6, duration_s=12.5, classification=kind, reason=reason)
    record.ranks = ranks or {}
    return record


@pytest.fixture
def launch_root(tmp_path: Path) -> Path:
    hung = "no progress for 61 s (hang timeout 60 s); suspect rank 1 (update 5, last mark 61 s ago)"
    figures = {"0": {"median_s_per_update": 0.123, "updates_seen": 45, "straggler": False},
               "1": {"median_s_per_update": 0.224, "updates_seen": 45, "straggler": True}}
    for record in (started("0001", 1, "hung", hung),
                   started("0001", 2, "done", "DONE: gen-000000000012", figures),
                   started("0002", 1, "done", "DONE: gen-000000000004")):
        append(str(tmp_path), record)
    with open(tmp_path / LAUNCH_LOG_NAME, "a") as log:
        log.write('{"run_id": "0003", "start": 1, "classif')  # a launcher killed mid-append
    return tmp_path


def test_runs_lists_starts_and_rank_figures(launch_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", str(launch_root)]) == 0
    out = capsys.readouterr().out
    assert f"{launch_root}/{LAUNCH_LOG_NAME}: 2 run(s)" in out
    assert "run 0001: 2 start(s)" in out and "run 0002: 1 start(s)" in out
    assert "hung" in out and "suspect rank 1 (update 5" in out
    assert ("start 2 ranks: rank 0 median 0.123 s/update over 45 updates; "
            "rank 1 median 0.224 s/update over 45 updates, straggler") in out


def test_runs_json_and_one_run_from_a_run_root(launch_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_root(str(launch_root), "0001")
    os.makedirs(run)
    assert main(["runs", run, "--run", "0001", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert list(shown["by_run"]) == ["0001"]
    assert [s["classification"] for s in shown["by_run"]["0001"]] == ["hung", "done"]
    assert shown["by_run"]["0001"][1]["ranks"]["1"]["straggler"] is True
    assert shown["by_run"]["0001"][1] == json.loads(json.dumps(asdict(started(
        "0001", 2, "done", "DONE: gen-000000000012", shown["by_run"]["0001"][1]["ranks"]))))


def test_runs_without_a_log_or_run_is_a_usage_error(
        launch_root: Path, tmp_path_factory: pytest.TempPathFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", str(tmp_path_factory.mktemp("empty"))]) == 2
    assert "no launch-log.jsonl under" in capsys.readouterr().err
    assert main(["runs", str(launch_root), "--run", "0009"]) == 2
    assert "no run '0009'" in capsys.readouterr().err


def test_a_start_that_rejected_generations_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # issue 38: the start line and `dist-ckpt runs` name the generations restore rejected
    record = started("0001", 2, "done", "DONE: gen-000000000012")
    record.resumed_from, record.resumed_tier = "gen-000000000008", "local"
    record.rejected = ["gen-000000000012 (dcp/__0_0.distcp) [/r]: digest mismatch",
                       "gen-000000000010 (objects/ab.obj) [/r]: size 3, manifest says 4"]
    line = record.line()
    assert ("resumed from gen-000000000008 (local tier); 2 newer rejected: "
            "gen-000000000012 (dcp/__0_0.distcp) [/r]: digest mismatch; gen-000000000010") in line
    append(str(tmp_path), record)
    assert main(["runs", str(tmp_path)]) == 0
    assert "gen-000000000008 (2 rejected: gen-000000000012, gen-000000000010)" in capsys.readouterr().out


def test_a_relaunched_run_numbers_its_starts_in_order_with_their_world(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40 item 12: the launcher's start number begins at 1 with each launch; the listing
    numbers a run's starts in order (#), shows each one's world size, and says what "no
    figure" means."""
    few = {"0": {"median_s_per_update": None, "updates_seen": 2, "straggler": False}}
    second = started("0001", 1, "done", "DONE: gen-000000000012", few)
    second.world_size = 3
    for record in (started("0001", 1, "finished", "stopped at 6", few), second):
        append(str(tmp_path), record)
    assert main(["runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert [row[:4] for row in rows] == [["1", "1", "2", "finished"], ["2", "1", "3", "done"]]
    assert "#1, start 1 ranks: rank 0 no figure (too few updates seen to measure)" in out
    assert "#2, start 1 ranks:" in out
    assert out.splitlines()[2].split()[:3] == ["#", "start", "world"]
