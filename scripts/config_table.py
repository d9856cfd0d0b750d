"""The README's configuration table, rendered from the descriptions of CheckpointConfig's fields.

    .venv/bin/python scripts/config_table.py           # print the table
    .venv/bin/python scripts/config_table.py --write   # replace the README's copy
    .venv/bin/python scripts/config_table.py --check   # exit 1 when the README's copy differs

The README's copy lies between the BEGIN and END marker lines; tests/test_readme.py fails when
it differs from ``dist_ckpt.config.config_table_markdown()``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_ckpt.config import config_table_markdown  # noqa: E402

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BEGIN = "<!-- config-table:begin (generated: python scripts/config_table.py --write) -->"
END = "<!-- config-table:end -->"


def split_readme(text: str) -> tuple[str, str, str]:
    """(before and including BEGIN line, the table, from the END line on)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"README.md needs exactly one {BEGIN!r} line followed by one {END!r} line")
    head, rest = text.split(BEGIN + "\n", 1)
    table, tail = rest.split(END, 1)
    return head + BEGIN + "\n", table, END + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's table differs")
    args = parser.parse_args()
    table = config_table_markdown()
    if not (args.write or args.check):
        sys.stdout.write(table)
        return 0
    with open(README, encoding="utf-8") as f:
        text = f.read()
    head, current, tail = split_readme(text)
    if args.check:
        if current != table:
            print("README.md's configuration table is stale: run python scripts/config_table.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if current != table:
        with open(README, "w", encoding="utf-8") as f:
            f.write(head + table + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
