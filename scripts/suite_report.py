"""The slowest tests and costliest modules of pytest JUnit reports:
``python scripts/suite_report.py JUNIT.xml... [--slowest N] [--modules N]``.

Prints the number of tests and their summed time, then the N slowest (setup, call and
teardown together, as pytest-xdist workers ran them), then the CPU of all tests and of each
test module, costliest first (``--modules N``: only the first N; each test's ``cpu_s``
property: its worker's and every process it started, tests/conftest.py), so that a new
module's cost shows in its own run. Read by ``.ci/run`` after the suite.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict


def _module(classname: str) -> str:
    """``tests.faults.test_kill`` of ``tests.faults.test_kill.TestRows`` (a class's tests
    count to their module)."""
    parts = classname.split(".")
    ends = [index for index, part in enumerate(parts) if part.startswith("test_")]
    return ".".join(parts[:ends[0] + 1] if ends else parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+")
    parser.add_argument("--slowest", type=int, default=10)
    parser.add_argument("--modules", type=int, default=None, help="modules listed (default: every one)")
    args = parser.parse_args(argv)
    cases = []
    module_cpu: dict[str, float] = defaultdict(float)
    for path in args.junit:
        try:
            tree = ElementTree.parse(path)
        except (OSError, ElementTree.ParseError) as exc:
            print(f"suite_report: cannot read {path}: {exc}", file=sys.stderr)
            return 1
        cases += [(float(case.get("time") or 0.0), f"{case.get('classname')}::{case.get('name')}")
                  for case in tree.iter("testcase")]
        for case in tree.iter("testcase"):
            for prop in case.iter("property"):
                if prop.get("name") == "cpu_s":
                    module_cpu[_module(case.get("classname") or "")] += float(prop.get("value") or 0)
    print(f"{len(cases)} tests, {sum(seconds for seconds, _ in cases):.0f} s of test time "
          f"(summed over workers); the {min(args.slowest, len(cases))} slowest:")
    for seconds, name in sorted(cases, reverse=True)[:args.slowest]:
        print(f"  {seconds:7.2f} s  {name}")
    if module_cpu:
        print(f"CPU of the tests: {sum(module_cpu.values()):.0f} s (each test's worker and every "
              f"process it started), by module, costliest first:")
        for module, seconds in sorted(module_cpu.items(), key=lambda pair: -pair[1])[:args.modules]:
            print(f"  {seconds:7.1f} s  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
