"""The README's configuration table names every CheckpointConfig field, and nothing else."""

from __future__ import annotations

import os
import re

from dist_ckpt import CheckpointConfig

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_configuration_table_lists_every_field() -> None:
    text = open(README, encoding="utf-8").read()
    section = text.split("### Configuration (`CheckpointConfig`)", 1)[1].split("\n### ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert documented == list(CheckpointConfig.model_fields)
