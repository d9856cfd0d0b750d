"""A bad ``CheckpointConfig`` says field, value and reason on one line, without pydantic's
type tags, input echo or documentation URL; a rule over several fields names the field to change."""

from __future__ import annotations

import pytest

from dist_ckpt import CheckpointConfig, ConfigError, DistCkptError


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


def test_the_peer_backend_is_gloo_or_nccl_where_cuda_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert message(root="x", peer_backend="tcp") == \
        "invalid CheckpointConfig: peer_backend='tcp': input should be 'gloo' or 'nccl'"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert message(root="x", peer_backend="nccl") == \
        "invalid CheckpointConfig: peer_backend='nccl': needs CUDA on every rank (none here); use \"gloo\""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert CheckpointConfig(root="x", peer_backend="nccl").peer_backend == "nccl"
