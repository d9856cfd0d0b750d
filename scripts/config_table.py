"""The configuration table of docs/configuration.md, rendered from CheckpointConfig's field descriptions.

    .venv/bin/python scripts/config_table.py           # print the table
    .venv/bin/python scripts/config_table.py --write   # replace the copy in docs/configuration.md
    .venv/bin/python scripts/config_table.py --check   # exit 1 when that copy differs

The page's copy lies between the BEGIN and END marker lines; tests/test_readme.py fails when
it differs from ``dist_ckpt.config.config_table_markdown()``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_ckpt.config import config_table_markdown  # noqa: E402

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")
BEGIN = "<!-- config-table:begin (generated: python scripts/config_table.py --write) -->"
END = "<!-- config-table:end -->"


def split_page(text: str) -> tuple[str, str, str]:
    """(before and including BEGIN line, the table, from the END line on)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"docs/configuration.md needs exactly one {BEGIN!r} line, then one {END!r} line")
    head, rest = text.split(BEGIN + "\n", 1)
    table, tail = rest.split(END, 1)
    return head + BEGIN + "\n", table, END + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="replace the table in docs/configuration.md")
    mode.add_argument("--check", action="store_true", help="exit 1 when the page's table differs")
    args = parser.parse_args()
    table = config_table_markdown()
    if not (args.write or args.check):
        sys.stdout.write(table)
        return 0
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    head, current, tail = split_page(text)
    if args.check:
        if current != table:
            print("docs/configuration.md's table is stale: run python scripts/config_table.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if current != table:
        with open(PAGE, "w", encoding="utf-8") as f:
            f.write(head + table + tail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
