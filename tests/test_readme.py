"""The README's configuration table is exactly the one rendered from CheckpointConfig's field
descriptions (``dist_ckpt.config.config_table_markdown()``), so the two cannot drift."""

from __future__ import annotations

import difflib
import os
import re

import pytest

from dist_ckpt import CheckpointConfig
from dist_ckpt.config import config_table_markdown

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BEGIN = "<!-- config-table:begin (generated: python scripts/config_table.py --write) -->"
END = "<!-- config-table:end -->"
REGENERATE = "python scripts/config_table.py --write"


def _configuration_section() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return text.split("### Configuration (`CheckpointConfig`)", 1)[1].split("\n### ", 1)[0]


def _readme_table() -> str:
    section = _configuration_section()
    assert section.count(BEGIN) == 1 and section.count(END) == 1, (
        f"the README's configuration section needs one {BEGIN!r} and one {END!r} line ({REGENERATE} "
        f"fills in the table between them)")
    return section.split(BEGIN + "\n", 1)[1].split(END, 1)[0]


def test_every_field_has_a_description() -> None:
    missing = [name for name, field in CheckpointConfig.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, f"CheckpointConfig fields without Field(description=...): {missing}"


def test_configuration_table_lists_every_field() -> None:
    documented = re.findall(r"^\| `([a-z_]+)` \|", _configuration_section(), flags=re.M)
    assert documented == list(CheckpointConfig.model_fields)


def test_configuration_table_is_generated_from_the_descriptions() -> None:
    current, expected = _readme_table(), config_table_markdown()
    if current != expected:
        diff = "".join(difflib.unified_diff(
            current.splitlines(keepends=True), expected.splitlines(keepends=True),
            fromfile="README.md (configuration table)", tofile="config_table_markdown()"))
        pytest.fail(f"README.md's configuration table differs from CheckpointConfig's field "
                    f"descriptions; regenerate it with `{REGENERATE}`:\n{diff}", pytrace=False)
