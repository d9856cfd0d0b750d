"""The documentation stays true to the code and reachable from the front door.

- docs/configuration.md's table is exactly the one rendered from CheckpointConfig's field
  descriptions (``dist_ckpt.config.config_table_markdown()``), so the two cannot drift;
- README.md is a front door (at most ``README_MAX_LINES`` lines) that links every docs page,
  and no relative link of the README or a docs page points at a missing file or heading."""

from __future__ import annotations

import difflib
import glob
import os
import re

import pytest

from dist_ckpt import CheckpointConfig
from dist_ckpt.config import config_table_markdown

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
CONFIG_PAGE = os.path.join(DOCS, "configuration.md")
BEGIN = "<!-- config-table:begin (generated: python scripts/config_table.py --write) -->"
END = "<!-- config-table:end -->"
REGENERATE = "python scripts/config_table.py --write"
FIELDS_HEADING = "## Fields"
README_MAX_LINES = 300
# [text](target) with a target that is not a URL or an in-page anchor
RELATIVE_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _configuration_section() -> str:
    return _read(CONFIG_PAGE).split(f"\n{FIELDS_HEADING}\n", 1)[1].split("\n## ", 1)[0]


def _page_table() -> str:
    section = _configuration_section()
    assert section.count(BEGIN) == 1 and section.count(END) == 1, (
        f"docs/configuration.md's {FIELDS_HEADING!r} section needs one {BEGIN!r} and one {END!r} "
        f"line ({REGENERATE} fills in the table between them)")
    return section.split(BEGIN + "\n", 1)[1].split(END, 1)[0]


def test_every_field_has_a_description() -> None:
    missing = [name for name, field in CheckpointConfig.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, f"CheckpointConfig fields without Field(description=...): {missing}"


def test_configuration_table_lists_every_field() -> None:
    documented = re.findall(r"^\| `([a-z_]+)` \|", _configuration_section(), flags=re.M)
    assert documented == list(CheckpointConfig.model_fields)


def test_configuration_table_is_generated_from_the_descriptions() -> None:
    current, expected = _page_table(), config_table_markdown()
    if current != expected:
        diff = "".join(difflib.unified_diff(
            current.splitlines(keepends=True), expected.splitlines(keepends=True),
            fromfile="docs/configuration.md (configuration table)", tofile="config_table_markdown()"))
        pytest.fail(f"docs/configuration.md's table differs from CheckpointConfig's field "
                    f"descriptions; regenerate it with `{REGENERATE}`:\n{diff}", pytrace=False)


def test_readme_is_a_front_door() -> None:
    lines = _read(README).count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): reference material belongs "
        f"in a page under docs/, linked from the README")


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {os.path.normpath(target.split("#", 1)[0])
              for target in RELATIVE_LINK.findall(_read(README))}
    pages = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(DOCS, "*.md")))
    assert pages, "no docs/*.md pages found"
    unlinked = [page for page in pages if page not in linked]
    assert not unlinked, f"docs pages that README.md does not link: {unlinked}"


def _anchors(path: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (code blocks skipped)."""
    anchors, fenced = set(), False
    for line in _read(path).splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_point_at_existing_files_and_headings() -> None:
    broken = []
    for page in [README, *sorted(glob.glob(os.path.join(DOCS, "*.md")))]:
        for target in RELATIVE_LINK.findall(_read(page)):
            path, _, anchor = target.partition("#")
            full = os.path.join(os.path.dirname(page), path)
            if not os.path.exists(full) or (anchor and full.endswith(".md")
                                            and anchor not in _anchors(full)):
                broken.append(f"{os.path.relpath(page, REPO)} -> {target}")
    assert not broken, f"relative links to missing files or headings: {broken}"
