"""A bad ``CheckpointConfig`` says field, value and reason on one line, without pydantic's
type tags, input echo or documentation URL; a rule over several fields names the field to change."""

from __future__ import annotations

import os
import re

import pytest

from dist_ckpt import CheckpointConfig, ConfigError, DistCkptError
from dist_ckpt.tiers.placement import RootGroups, check_root_groups


def message(**fields: object) -> str:
    with pytest.raises(ConfigError) as info:
        CheckpointConfig(**fields)
    assert isinstance(info.value, DistCkptError)
    text = str(info.value)
    assert "\n" not in text and "pydantic" not in text and "input_value" not in text
    assert "[type=" not in text and "https://" not in text
    return text


def test_field_value_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DIST_CKPT_ROOT", raising=False)
    assert message() == ("invalid CheckpointConfig: root='': root is required (pass root= or set "
                         "DIST_CKPT_ROOT)")
    assert message(root="x", max_in_flight=0) == \
        "invalid CheckpointConfig: max_in_flight=0: input should be greater than or equal to 1"
    assert message(root="x", in_flight_policy="drop") == \
        "invalid CheckpointConfig: in_flight_policy='drop': input should be 'block' or 'skip'"
    assert message(root="x", frob=1) == "invalid CheckpointConfig: frob: not a CheckpointConfig field"


def test_every_problem_on_one_line() -> None:
    text = message(root="x", max_in_flight=0, io_threads="many")
    assert text.startswith("invalid CheckpointConfig: max_in_flight=0: ") and "; io_threads='many': " in text


def test_cross_field_rules_name_the_field_to_change() -> None:
    assert message(root="x", async_save=True, keep_last=1) == (
        "invalid CheckpointConfig: keep_last=1: must be at least 2 with async_save=True: the newest "
        "generation may still be in flight")
    assert message(root="x", cadence="auto").startswith("invalid CheckpointConfig: save_every=None: required")
    assert message(root="x", persist_interval_s=60).startswith(
        "invalid CheckpointConfig: persist_interval_s=60.0: needs memory_tier=True")
    assert message(root="x", mirror="/tmp/elsewhere").startswith(
        "invalid CheckpointConfig: mirror='/tmp/elsewhere': needs a local root")
    assert "config" not in message(root="x", async_save=True, keep_last=1).split(":")[1]


def test_secrets_are_never_shown() -> None:
    text = message(root="x", hmac_key="short-secret")
    assert "short-secret" not in text and "hmac_key=(hidden): " in text
    text = message(root="x", storage_options="key=secret-value")
    assert "secret-value" not in text and "storage_options=(hidden): " in text


# ---- the combinations of root, memory tier and mirror (docs/configuration.md) ------------------
PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")


def refusal(root: str, memory: bool, mirror: str) -> str:
    """The message of the refused combination of one table row, produced as a job would
    (short paths: a long value is shortened in the message)."""
    local = "/ckpt"
    if root.startswith("object store"):
        return message(root="s3://bucket/run", memory_tier=memory, mirror="s3://bucket/mirror")
    if mirror == "a local path":
        return message(root=local, memory_tier=memory, mirror="/elsewhere")
    assert root == "local, node-local" and mirror == "none", root
    config = CheckpointConfig(root=local, memory_tier=memory)
    check_root_groups(config, RootGroups())  # one node, or a root every node shares
    with pytest.raises(ConfigError) as info:
        check_root_groups(config, RootGroups(leader=0, leaders=(0, 1)))  # what place_tiers found
    return str(info.value)


def refused_rows() -> list[tuple[str, str, str, str]]:
    text = open(PAGE, encoding="utf-8").read().split("## Combinations of root, memory tier and mirror")[1]
    lines = text.split("\n## ")[0].splitlines()
    rows = [[c.strip() for c in line.strip("|\n ").split(" | ")] for line in lines
            if line.startswith("| ") and "refused:" in line]
    return [(root, memory, mirror, re.search(r"refused: `([^`]+)`", outcome).group(1))
            for root, memory, mirror, outcome in rows]


def test_every_refused_combination_says_what_the_table_quotes() -> None:
    rows = refused_rows()
    assert len(rows) == 4
    for root, memory, mirror, quoted in rows:
        pattern = re.escape(quoted).replace(re.escape("..."), ".*")
        for memory_tier in {"off": [False], "on": [True]}.get(memory, [False, True]):
            text = refusal(root, memory_tier, mirror)
            assert re.match(pattern, text), (root, memory, mirror, text)


def test_node_local_roots_without_a_mirror_name_the_field(tmp_path) -> None:
    config = CheckpointConfig(root=str(tmp_path), memory_tier=True)
    with pytest.raises(ConfigError) as info:
        check_root_groups(config, RootGroups(leader=1, leaders=(0, 1, 2)))
    assert str(info.value).startswith(
        f"invalid CheckpointConfig: mirror=None: required when root={config.root!r} "
        "is node-local (3 nodes, each with its own copy)")
    check_root_groups(CheckpointConfig(root=str(tmp_path), mirror="s3://b/m"), RootGroups(1, (0, 1, 2)))


def test_mirror_every_needs_a_mirror() -> None:
    assert message(root="x", mirror_every=2) == \
        "invalid CheckpointConfig: mirror_every=2: needs mirror (an s3:// URL)"
    assert message(root="x", mirror="s3://b/m", mirror_every=0).startswith(
        "invalid CheckpointConfig: mirror_every=0: input should be greater than or equal to 1")


def test_the_peer_backend_is_gloo_or_nccl_where_cuda_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert message(root="x", peer_backend="tcp") == \
        "invalid CheckpointConfig: peer_backend='tcp': input should be 'gloo' or 'nccl'"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert message(root="x", peer_backend="nccl") == \
        "invalid CheckpointConfig: peer_backend='nccl': needs CUDA on every rank (none here); use \"gloo\""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CheckpointConfig(root="x", peer_backend="nccl").peer_backend == "nccl"
