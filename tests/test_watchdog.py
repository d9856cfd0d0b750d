"""The launcher's watchdog (launch/watchdog.py): hang rules and the straggler figure, on
made-up marks; no process starts. The launcher tests are in tests/test_launch_watchdog.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from launch.options import parse
from launch.watchdog import Stragglers, Watchdog


@dataclass(frozen=True)
class M:
    rank: int
    update: int
    mark_s: float
    longest_s: float = 0.0
    section: str = ""
    deadline_s: float = 0.0
    count: int = 1
    pid: int = 0


def marks(*items: M) -> dict[int, M]:
    return {m.rank: m for m in items}


def test_fixed_timeout_names_the_rank_furthest_behind() -> None:
    dog = Watchdog(30, 900)
    dog.begin(0.0)
    seen = marks(M(0, 58, 100.0), M(1, 57, 99.5), M(2, 58, 100.1))
    assert dog.observe(seen, 129.0) is None
    hung = dog.observe(seen, 162.5)
    assert hung is not None and hung.suspects == (1,)
    assert hung.reason == ("no progress for 62 s (hang timeout 30 s); suspect rank 1 "
                           "(update 57, last mark 63 s ago)")


def test_ranks_at_the_same_update_and_time_are_all_suspects() -> None:
    dog = Watchdog(10, 900)
    dog.begin(0.0)
    hung = dog.observe(marks(M(0, 7, 50.0), M(1, 7, 50.2), M(2, 8, 51.0)), 70.0)
    assert hung is not None and hung.suspects == (0, 1) and "suspects rank 0" in hung.reason


def test_a_section_is_progress_until_its_deadline_then_hung() -> None:
    dog = Watchdog(5, 900)
    dog.begin(0.0)
    saving = marks(M(0, 4, 10.0, section="save", deadline_s=310.0),
                   M(1, 4, 10.0, section="save", deadline_s=310.0))
    assert dog.observe(saving, 300.0) is None  # a save longer than the hang timeout is no hang
    assert dog.observe(saving, 314.0) is None  # the deadline counts as the last progress
    hung = dog.observe(saving, 316.0)
    assert hung is not None and hung.suspects == (0, 1) and "in save 6 s past its deadline" in hung.reason


def test_a_rank_stuck_in_a_section_past_its_deadline_is_the_suspect() -> None:
    dog = Watchdog(5, 900)
    dog.begin(0.0)
    seen = marks(M(0, 4, 10.0), M(1, 4, 10.0, section="save", deadline_s=20.0))
    assert dog.observe(seen, 24.0) is None
    hung = dog.observe(seen, 26.0)
    assert hung is not None and hung.suspects == (1,)


def test_auto_timeout_is_ten_times_the_longest_interval_and_at_least_60_s() -> None:
    dog = Watchdog("auto", 900)
    dog.begin(0.0)
    assert dog.observe(marks(M(0, 3, 10.0, longest_s=2.0), M(1, 3, 10.0, longest_s=1.0)), 69.0) is None
    assert dog.timeout_s() == 60.0
    hung = dog.observe(marks(M(0, 3, 10.0, longest_s=2.0)), 71.0)
    assert hung is not None and "hang timeout 60 s" in hung.reason
    dog.observe(marks(M(0, 9, 100.0, longest_s=8.5)), 101.0)
    assert dog.timeout_s() == 85.0
    dog.begin(200.0)  # a new start keeps what the run taught
    assert dog.timeout_s() == 85.0
    assert dog.observe(marks(M(0, 10, 210.0, longest_s=0.1)), 290.0) is None
    assert dog.observe(marks(M(0, 10, 210.0, longest_s=0.1)), 296.0) is not None


def test_startup_timeout_applies_before_the_first_mark() -> None:
    dog = Watchdog(5, 900)
    dog.begin(1000.0)
    assert dog.observe({}, 1899.0) is None
    hung = dog.observe({}, 1901.0)
    assert hung is not None and hung.suspects == ()
    assert hung.reason == "no rank marked progress within the startup timeout of 900 s"
    # a restore (a section before any mark) holds until its deadline, then the startup timeout
    dog.begin(0.0)
    restoring = marks(M(0, -1, 0.0, section="restore", deadline_s=1200.0, count=0))
    assert dog.observe(restoring, 1100.0) is None
    assert dog.observe(restoring, 2099.0) is None
    assert dog.observe(restoring, 2101.0) is not None


def test_teardown_after_finish_gets_the_startup_timeout() -> None:
    dog = Watchdog(5, 300)
    dog.begin(0.0)
    dog.observe(marks(M(0, 6, 10.0, section="finish", deadline_s=900.0),
                      M(1, 6, 10.0, section="finish", deadline_s=900.0)), 12.0)
    assert dog.observe(marks(M(0, 6, 10.0), M(1, 6, 10.0, section="finish", deadline_s=900.0)), 20.0) is None
    finished = marks(M(0, 6, 10.0), M(1, 6, 10.0))
    assert dog.observe(finished, 309.0) is None
    hung = dog.observe(finished, 311.0)
    assert hung is not None and hung.reason.startswith("no exit 301 s after finish (startup timeout 300 s)")
    # only some ranks got to finish: the others are not tearing down, the hang timeout holds
    dog.begin(400.0)
    dog.observe(marks(M(0, 6, 410.0, section="finish", deadline_s=900.0), M(1, 5, 409.0)), 411.0)
    assert dog.observe(marks(M(0, 6, 410.0), M(1, 5, 409.0)), 416.0) is not None


def test_a_rank_that_never_marked_is_the_suspect() -> None:
    dog = Watchdog(5, 900)
    dog.begin(0.0)
    hung = dog.observe(marks(M(0, 3, 10.0), M(1, -1, 0.0, count=0)), 20.0)
    assert hung is not None and hung.suspects == (1,) and "rank 1 (no mark yet)" in hung.reason


def lock_step(extra: list[float], *, step_s: float = 0.1, updates: int = 60, poll_s: float = 0.2,
              jitter: float = 0.0, window: int = 20) -> tuple[list[tuple[int, str]], Stragglers]:
    """Ranks in lock step (every update starts when the last rank marked the previous one),
    rank r spending ``step_s + extra[r]`` of its own; the launcher polls every ``poll_s`` and
    sees each rank's newest mark. Returns (update of rank 0 when a line came, line)."""
    rng = random.Random(5)
    times: dict[int, list[tuple[int, float]]] = {r: [] for r in range(len(extra))}
    previous = [0.0] * len(extra)
    for update in range(1, updates + 1):
        begin = max(previous)
        previous = [begin + step_s + e + rng.uniform(0, jitter) for e in extra]
        for rank, at in enumerate(previous):
            times[rank].append((update, at))
    tracker, lines, now = Stragglers(1.5, window, "node-a"), [], 0.0
    while now < max(previous) + poll_s:
        current = {}
        for rank, series in times.items():
            done = [(u, t) for u, t in series if t <= now]
            if done:
                current[rank] = M(rank, done[-1][0], done[-1][1], count=len(done))
        lines += [(current[0].update, line) for line in tracker.observe(current)]
        now += poll_s
    return lines, tracker


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_balanced_run_names_nobody(ranks: int) -> None:
    lines, tracker = lock_step([0.0] * ranks, jitter=0.02)
    assert lines == []
    figures = tracker.figures()
    assert sorted(figures) == [str(r) for r in range(ranks)]
    assert not any(f["straggler"] for f in figures.values())
    assert all(f["updates_seen"] >= 55 for f in figures.values())


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_slower_than_the_factor_is_named_within_one_window(ranks: int) -> None:
    extra = [0.0] * ranks
    extra[1] = 0.06  # its own time per update: 1.6 x the others'
    lines, tracker = lock_step(extra, jitter=0.01)
    assert len(lines) == 1, lines
    update, line = lines[0]
    assert update <= 20, f"named only at update {update}: later than one window"
    assert line.startswith("[launch] straggler: rank 1 on node-a median 0.16")
    assert "job median 0.1" in line and "s/update" in line
    figures = tracker.figures()
    assert figures["1"]["straggler"] and not figures["0"]["straggler"]
    assert figures["1"]["median_s_per_update"] == pytest.approx(0.165, abs=0.01)


def test_fifty_percent_more_own_work_is_the_factor_itself_and_is_named() -> None:
    """Own time per update is what the rank adds: 50% more work reads 1.5 x the job's, not the
    job's pace (which every rank shares in lock step); at the default factor it is named."""
    lines, tracker = lock_step([0.0, 0.05])
    assert tracker.figure(0) == pytest.approx(0.10, abs=1e-6)
    assert tracker.figure(1) == pytest.approx(0.15, abs=1e-6)
    assert tracker.job_figure() == pytest.approx(0.10, abs=1e-6)
    assert [line.split(" on ")[0] for _, line in lines] == ["[launch] straggler: rank 1"]
    assert lines[0][0] <= 20, "named later than one window"


def test_a_straggler_that_recovers_is_cleared_once() -> None:
    tracker = Stragglers(1.5, 10, "n")
    times = {0: 0.0, 1: 0.0}
    lines = []
    for update in range(1, 80):
        extra = 0.1 if update < 30 else 0.0
        begin = max(times.values())
        times = {0: begin + 0.1, 1: begin + 0.1 + extra}
        lines += tracker.observe({r: M(r, update, t, count=update) for r, t in times.items()})
    assert [line.split(":")[0] for line in lines] == [
        "[launch] straggler", "[launch] rank 1 on n no longer a straggler"]


def test_options_validate_with_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--checkpoint-root", "/r", "--standalone", "train.py"]
    options = parse(base)
    assert options.hang_timeout == "auto" and options.startup_timeout == 900
    assert options.straggler_factor == 1.5 and options.straggler_window == 20
    options = parse(["--hang-timeout", "45", "--startup-timeout", "300", "--straggler-factor", "2",
                     "--straggler-window", "8", *base])
    assert (options.hang_timeout, options.startup_timeout) == (45.0, 300.0)
    assert (options.straggler_factor, options.straggler_window) == (2.0, 8)
    assert "--hang-timeout" not in options.torchrun_argv
    for bad, message in [(["--hang-timeout", "soon"], "--hang-timeout wants seconds (> 0) or auto"),
                         (["--hang-timeout", "0"], "--hang-timeout wants seconds (> 0) or auto"),
                         (["--startup-timeout", "-1"], "--startup-timeout must be a positive"),
                         (["--straggler-factor", "1"], "--straggler-factor must be more than 1"),
                         (["--straggler-window", "2"], "--straggler-window must be at least 3")]:
        with pytest.raises(SystemExit) as exited:
            parse([*bad, *base])
        assert exited.value.code == 2 and message in capsys.readouterr().err, bad


def test_a_rank_that_stopped_marking_while_peers_wait_in_a_section_is_the_suspect() -> None:
    # issue 38: rank 1 stopped between steps; rank 0 waits in the next save for it. The save's
    # long deadline must not hide rank 1, and rank 0 (waiting) is never the suspect
    dog = Watchdog(60, 900)
    dog.begin(0.0)
    waiting = marks(M(0, 11, 100.0, section="save", deadline_s=400.0), M(1, 11, 99.0))
    assert dog.observe(waiting, 158.0) is None  # rank 1 marked 59 s ago: within the timeout
    hung = dog.observe(waiting, 160.0)
    assert hung is not None and hung.suspects == (1,)
    assert "while rank(s) 0 wait in save" in hung.reason and "suspect rank 1 (update 11" in hung.reason


def test_a_stopped_rank_inside_a_section_is_not_taken_for_working_there() -> None:
    dog = Watchdog(60, 900)
    dog.begin(0.0)
    restoring = marks(M(0, 0, 10.0, section="restore", deadline_s=700.0),
                      M(1, 0, 10.0, section="restore", deadline_s=700.0))
    assert dog.observe(restoring, 200.0) is None  # both running: a long restore is no hang
    assert dog.observe(restoring, 69.0, stopped=frozenset({1})) is None  # stopped, within the timeout
    hung = dog.observe(restoring, 71.0, stopped=frozenset({1}))
    assert hung is not None and hung.suspects == (1,)
    assert "its process stopped" in hung.reason and "wait in restore" in hung.reason


def test_ranks_all_outside_sections_keep_the_furthest_behind_rule() -> None:
    dog = Watchdog(60, 900)
    dog.begin(0.0)
    training = marks(M(0, 12, 100.0), M(1, 11, 99.0))  # rank 0 blocked in the next step's collective
    assert dog.observe(training, 159.0) is None  # rank 0's mark is within the timeout
    hung = dog.observe(training, 161.0)
    assert hung is not None and hung.suspects == (1,)


def test_a_rank_stopped_inside_finish_is_found_within_the_hang_timeout() -> None:
    # after finish the startup timeout covers the exits; a stopped process is no exit
    dog = Watchdog(60, 900)
    dog.begin(0.0)
    finishing = marks(M(0, 12, 100.0, section="finish", deadline_s=800.0),
                      M(1, 12, 100.0, section="finish", deadline_s=800.0))
    assert dog.observe(finishing, 150.0) is None
    assert dog.observe(finishing, 170.0) is None  # both running: the teardown may take long
    hung = dog.observe(finishing, 161.0, stopped=frozenset({1}))
    assert hung is not None and hung.suspects == (1,) and "wait in finish" in hung.reason
