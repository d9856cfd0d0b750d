"""The suite's CPU accounting (docs/testing.md, the budget): a test's CPU counts the processes
it started, ``scripts/cputime.py`` counts an orphan's CPU, and the report sums by module."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.cpu import spent, tree_cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# burns about this much CPU, then exits
BURN_S = 0.4
BURN = f"import time\nend = time.process_time() + {BURN_S}\nwhile time.process_time() < end: pass\n"


@pytest.mark.processes
def test_a_tests_cpu_counts_the_processes_it_started() -> None:
    before = tree_cpu()
    subprocess.run([sys.executable, "-c", BURN], check=True, timeout=60)
    assert spent(before, tree_cpu()) >= BURN_S * 0.9


def test_a_process_that_ended_counts_only_what_it_spent_after_the_first_reading() -> None:
    # pid 2 lived through both readings; pid 3 ended in between (its whole life is now in
    # its reaper's, pid 1's, children's time); pid 4 is new
    before = {1: 10.0, 2: 5.0, 3: 7.0}
    after = {1: 10.0 + 7.5, 2: 6.0, 4: 2.0}
    assert spent(before, after) == pytest.approx(0.5 + 1.0 + 2.0)


@pytest.mark.processes
def test_cputime_counts_an_orphans_cpu(tmp_path) -> None:
    # the parent exits at once; its child, an orphan, burns the CPU after it
    orphan = (f"import os\nif os.fork() == 0:\n    exec({BURN!r})\n    os._exit(0)\nos._exit(0)\n")
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "cputime.py"), "label", "--",
                           sys.executable, "-c", orphan], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found = re.search(r"^label: wall \d+ s, CPU ([\d.]+) s .*every process it started\)", done.stdout, re.M)
    assert found is not None, done.stdout
    assert float(found.group(1)) >= BURN_S * 0.9, done.stdout
    assert "orphans not counted" not in done.stdout and "still running" not in done.stdout


@pytest.mark.processes
def test_cputime_exits_with_the_commands_status() -> None:
    done = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "cputime.py"), "label", "--",
                           sys.executable, "-c", "raise SystemExit(7)"], capture_output=True, timeout=60)
    assert done.returncode == 7


def test_the_report_sums_cpu_by_module(tmp_path, capsys) -> None:
    from scripts.suite_report import main

    (tmp_path / "r.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.faults.test_kill" name="a" time="2.0">'
        '<properties><property name="cpu_s" value="3.5"/></properties></testcase>'
        '<testcase classname="tests.faults.test_kill.TestRows" name="b" time="1.0">'
        '<properties><property name="cpu_s" value="1.5"/></properties></testcase>'
        '<testcase classname="tests.test_units" name="c" time="0.1">'
        '<properties><property name="cpu_s" value="0.5"/></properties></testcase>'
        '</testsuite></testsuites>')
    assert main([str(tmp_path / "r.xml"), "--slowest", "5"]) == 0
    out = capsys.readouterr().out
    assert "CPU of the tests: 6 s" in out and "by module, costliest first" in out
    lines = out.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("CPU of the tests")))
    assert lines[first + 1].split() == ["5.0", "s", "tests.faults.test_kill"]
    assert lines[first + 2].split() == ["0.5", "s", "tests.test_units"]
