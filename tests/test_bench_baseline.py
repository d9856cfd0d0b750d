"""scripts/bench/baseline.py: the compare phase's guard against a stored baseline (pure: made-up
tables, no run)."""

from __future__ import annotations

import json

from scripts.bench import baseline
from scripts.bench.compare_methods import DCP_ASYNC, OUR_EAGER
from scripts.bench.compare_report import BLOCK, LOST, WRITTEN


def table(lost: float, block: float = 0.1) -> dict:
    return {BLOCK: {OUR_EAGER: [block, block, block], DCP_ASYNC: [0.12, 0.12, 0.12]},
            LOST: {OUR_EAGER: [lost - 0.01, lost, lost + 0.01], DCP_ASYNC: [0.8, 0.8, 0.8]},
            WRITTEN: {OUR_EAGER: [512.0, 512.0, 512.0]}}


def stored(tmp_path, lost: float = 0.124) -> tuple[str, dict]:
    path = str(tmp_path / "b.json")
    cfg = {"state_mib": 512, "job": "full", "kind": "fsdp", "steps": 4}
    baseline.write(path, baseline.record(table(lost), cfg, commit="3912524", machine="m",
                                         command="python -m scripts.bench --compare"))
    loaded = baseline.load(path)
    assert loaded is not None
    return path, loaded


def test_a_run_like_the_baseline_names_nothing(tmp_path, capsys) -> None:
    path, loaded = stored(tmp_path)
    flagged = baseline.print_against(table(0.13), [OUR_EAGER, DCP_ASYNC], loaded, path, "m")
    out = capsys.readouterr().out
    assert flagged == [] and "against the baseline of 3912524" in out and "none" in out
    assert "0.130 x1.05" in out and "another machine" not in out


def test_ten_times_the_time_lost_is_named_as_a_regression(tmp_path, capsys) -> None:
    path, loaded = stored(tmp_path)
    flagged = baseline.print_against(table(1.164), [OUR_EAGER, DCP_ASYNC], loaded, path, "m")
    out = capsys.readouterr().out
    assert len(flagged) == 1 and flagged[0].startswith(LOST.strip()) and "1.164 against 0.124" in flagged[0]
    assert "TRAINING TIME LOST REGRESSED" in out and "x9.39!" in out


def test_noise_on_a_small_figure_is_not_a_regression() -> None:
    assert not baseline.worse(BLOCK, 0.02, 0.01)  # twice, but 0.01 s more: within the slack
    assert baseline.worse(BLOCK, 0.2, 0.1)
    assert baseline.worse(WRITTEN, 620.0, 512.0)  # MiB: no seconds slack
    assert not baseline.worse(LOST, -0.18, -0.2)  # a negative baseline (noise): judged by difference
    assert baseline.worse(LOST, -0.1, -0.2)
    # beyond the ratio, but the two runs' middle halves overlap: noise, not a regression
    assert not baseline.worse(LOST, 0.357, -0.048, today_q1=-0.02, then_q3=0.135)
    assert baseline.worse(LOST, 1.164, 0.124, today_q1=1.0, then_q3=0.2)


def test_a_missing_or_foreign_baseline_is_said_so(tmp_path, capsys) -> None:
    assert baseline.load(str(tmp_path / "absent.json")) is None
    (tmp_path / "bad.json").write_text(json.dumps({"no": "medians"}))
    assert baseline.load(str(tmp_path / "bad.json")) is None
    assert baseline.print_against(table(1.0), [OUR_EAGER], None, "X", "m") == []
    assert "no baseline at X" in capsys.readouterr().out
    path, loaded = stored(tmp_path)
    baseline.print_against(table(0.124), [OUR_EAGER], loaded, path, "another")
    assert "measured on another machine" in capsys.readouterr().out


def test_the_default_path_is_per_job_kind_and_size() -> None:
    path = baseline.default_path({"state_mib": 512, "job": "finetune", "kind": "ddp"})
    assert path.endswith("scripts/bench/baselines/compare-finetune-ddp-512.json")


def test_time_lost_pairs_are_averaged_one_of_either_order() -> None:
    """Pairs alternate which run comes first; a busy machine slows the first run of a pair,
    which splits raw pairs into two clusters. Averaged two by two, the order cancels."""
    from scripts.bench.compare_report import order_balanced

    first_slow = [0.5 + 0.4, 0.5 - 0.4] * 3 + [2.0]  # an unmatched last pair is left out
    assert order_balanced(first_slow) == [0.5, 0.5, 0.5]
    assert order_balanced([0.3]) == []
