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


def _launcher_sample() -> list[str]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    block = text.split("What that looks like", 1)[1].split("```\n", 2)[1]
    return block.splitlines()


def test_the_readme_launcher_sample_is_the_launchers_own_formatting() -> None:
    """The sample output in the README (a real run of the demo's phase 3) is what the launcher
    prints for those starts today: the start lines and the summary are rebuilt from their
    values with the launcher's own formatting, so a change of format fails here."""
    from launch import records

    sample = _launcher_sample()
    starts = [
        records.StartRecord(run_id="0001", start=1, max_starts=3, nodes="1", procs_per_node="2",
                            world_size=2, resumed_from="fresh", resumed_update=0, final_update=8,
                            updates=8, duration_s=9.7, classification="transient",
                            reason="rank 1 killed by SIGKILL; rank 0 stopped by torchrun"),
        records.StartRecord(run_id="0001", start=2, max_starts=3, nodes="1", procs_per_node="2",
                            world_size=2, resumed_from="gen-000000000008", resumed_update=8,
                            resumed_tier="local", final_update=24, updates=16, duration_s=13.3,
                            classification="done",
                            reason="DONE: gen-000000000024, 384 tokens seen"),
    ]
    for record in starts:
        assert record.line() in sample
    summary = records.summary(starts, "done: DONE: gen-000000000024, 384 tokens seen (exit 0)")
    assert "\n".join(sample[-4:]) == summary
    assert re.fullmatch(r"\[launch\] run 0001 \(new\) in \S+/runs/0001; stop file \S+/STOP", sample[0])
    assert re.fullmatch(r"\[launch\] training: rank 0 pid \d+, rank 1 pid \d+", sample[1])
