"""The slowest tests of pytest JUnit reports: ``python scripts/test_report.py JUNIT.xml... [--slowest N]``.

Prints the number of tests and their summed time, then the N slowest (setup, call and
teardown together, as pytest-xdist workers ran them). Read by ``.ci/run`` after the suite.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+")
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args(argv)
    cases = []
    for path in args.junit:
        try:
            tree = ElementTree.parse(path)
        except (OSError, ElementTree.ParseError) as exc:
            print(f"test_report: cannot read {path}: {exc}", file=sys.stderr)
            return 1
        cases += [(float(case.get("time") or 0.0), f"{case.get('classname')}::{case.get('name')}")
                  for case in tree.iter("testcase")]
    print(f"{len(cases)} tests, {sum(seconds for seconds, _ in cases):.0f} s of test time "
          f"(summed over workers); the {min(args.slowest, len(cases))} slowest:")
    for seconds, name in sorted(cases, reverse=True)[:args.slowest]:
        print(f"  {seconds:7.2f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
