"""The experiment contract: canonical JSON of its values, refusals naming the key path, the
values kept in the manifest and a mismatch that names the key and both values."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pydantic
import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, ConfigError, ContractMismatch, TrainState
from dist_ckpt.errors import ABSENT, ValidationError
from dist_ckpt.format.manifest import FORMAT_VERSION, Manifest
from dist_ckpt.restart import contract
from dist_ckpt.restart.canonical import MAX_ARRAY_ITEMS, canonical
from tests.helpers.local_jobs import step

LORA = {"r": 16, "lora_alpha": 32, "target_modules": {"q_proj", "k_proj", "v_proj", "o_proj"}}


def old_digest(value: object) -> str:
    """What ``field_digest`` computed before canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass
class Adapter:
    r: int
    modules: frozenset[str]
    color: Color


class Model(pydantic.BaseModel):
    name: str
    tags: set[str]
    adapter: Adapter


# ---- canonical JSON ------------------------------------------------------------------------


@pytest.mark.processes
def test_a_set_digests_the_same_under_any_hash_seed() -> None:
    code = ("import sys, dist_ckpt.restart.contract as c; assert 'torch' not in sys.modules; "
            "print(c.normalize({'config': {'lora': {'target_modules': {'q_proj', 'k_proj', "
            "'v_proj', 'o_proj', 'gate_proj', 1, 2.5, None, ('a', 1)}}}})['config'])")
    outputs = set()
    for seed in map(str, range(1, 21)):  # issue 38: 20 hash seeds, one digest
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True, timeout=60)
        outputs.add(done.stdout.strip())
    assert len(outputs) == 1 and next(iter(outputs)).startswith("sha256:")


def test_plain_json_keeps_its_digest_and_a_string_is_a_digest() -> None:
    plain = {"lr": 1e-2, "batch": 8, "layers": [1, 2.5, None, True], "by_id": {10: "a", 2: "b"}}
    assert contract.normalize({"config": plain})["config"] == old_digest(plain)
    assert contract.normalize({"config": "v1", "blob": b"xy"}) == {
        "blob": "sha256:" + hashlib.sha256(b"xy").hexdigest(), "config": "v1"}
    assert contract.field_digest(("a", 1)) == old_digest(["a", 1])


def test_values_without_json_types_have_a_canonical_form() -> None:
    adapter = Adapter(r=8, modules=frozenset({"v", "q"}), color=Color.RED)
    assert canonical(adapter) == {"color": "red", "modules": ["q", "v"], "r": 8}
    model = Model(name="m", tags={"b", "a"}, adapter=adapter)
    assert canonical(model) == {"adapter": {"color": "red", "modules": ["q", "v"], "r": 8},
                                "name": "m", "tags": ["a", "b"]}
    assert canonical({Level.LOW: Color.RED, None: pathlib.PurePosixPath("/data/x")}) == {
        "1": "red", "null": "/data/x"}
    assert canonical({1, "a", None, 2.5}) == ["a", 1, 2.5, None]  # by canonical text: '"a"' < '1'
    assert canonical((np.int64(3), np.float32(0.5), np.bool_(True))) == [3, 0.5, True]
    assert canonical(np.arange(4).reshape(2, 2)) == [[0, 1], [2, 3]]
    assert canonical(torch.tensor([1.0, 2.0])) == [1.0, 2.0]
    assert canonical({"blob": b"xy"}) == {"blob": "sha256:" + hashlib.sha256(b"xy").hexdigest()}


@pytest.mark.parametrize("value, where, what", [
    ({"lora": {"fn": lambda: 1}}, "contract['config']['lora']['fn']", "a function"),
    ({"act": torch.relu}, "contract['config']['act']", "a function"),
    ({"cls": Adapter}, "contract['config']['cls']", "a class (Adapter)"),
    ({"x": [object()]}, "contract['config']['x'][0]", "an object of type builtins.object"),
    ({"s": {object()}}, "contract['config']['s'][<set element>]", "an object of type"),
    ({"w": np.zeros(MAX_ARRAY_ITEMS + 1)}, "contract['config']['w']", "a numpy array of"),
    ({(1, 2): "tuple key"}, "contract['config']", "a key of type tuple"),
    ({1: "a", "1": "b"}, "contract['config']", "keys 1 and '1' are the same JSON key"),
])
def test_a_value_without_canonical_form_is_refused_naming_its_key_path(value, where, what) -> None:
    with pytest.raises(ConfigError) as caught:
        contract.build({"config": value})
    assert str(caught.value).startswith(f"{where}: {what}"), caught.value


def test_a_cycle_is_refused() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="nested deeper"):
        contract.build({"config": loop})


def test_train_state_refuses_before_any_manager_exists() -> None:
    with pytest.raises(ConfigError, match=r"^contract\['config'\]\['lora'\]\['fn'\]: a function"):
        TrainState(torch.nn.Linear(2, 2), contract={"config": {"lora": {**LORA, "fn": print}}})


def test_extras_digests_stay_lenient() -> None:
    big = np.zeros(MAX_ARRAY_ITEMS + 1)
    assert contract.field_digest(big) == old_digest(big)  # a save does not fail on it


# ---- kept values, bound, mismatch message ---------------------------------------------------


def test_the_values_are_bounded_and_the_rest_keeps_its_digest() -> None:
    big = "x" * (40 << 10)
    spec = contract.build({"a": {"text": big}, "b": {"text": big}, "c": {"n": 1}})
    assert set(spec.values) == {"a", "c"} and set(spec.digests) == {"a", "b", "c"}
    assert sum(len(json.dumps(v)) for v in spec.values.values()) <= contract.MAX_VALUES_BYTES
    saved = contract.build({"a": {"text": big}, "b": {"text": big + "y"}, "c": {"n": 1}})
    with pytest.raises(ContractMismatch) as caught:
        contract.check(saved.digests, spec, allow_change=False, saved_values=saved.values)
    assert caught.value.changes == [("b", saved.digests["b"], spec.digests["b"])]


def manifest_with(spec: contract.Contract) -> Manifest:
    manifest = Manifest(
        format_version=FORMAT_VERSION, generation="gen-000000000001", next_update=1, tokens_seen=1,
        world_size=1, components=[], contract=spec.digests, contract_digest=contract.digest(spec.digests),
        contract_values=spec.values or None, torch_version="0", dist_ckpt_version="0",
        created_unix=1.7e9, save_duration_s=1.0, total_bytes=0, files=[])
    return Manifest.from_bytes(manifest.to_bytes(), generation="gen-000000000001")


def test_a_changed_nested_key_is_named_with_both_values() -> None:
    saved = manifest_with(contract.build({"config": {"lora": LORA, "lr": 1e-4}, "data": "v1"}))
    now = contract.build({"config": {"lora": {**LORA, "r": 8, "dropout": 0.1}, "lr": 1e-4},
                          "data": "v1"})
    with pytest.raises(ContractMismatch) as caught:
        contract.check(saved.contract, now, allow_change=False, saved_values=saved.contract_values)
    error = caught.value
    assert set(error.fields) == {"config"}
    assert error.changes == [("config.lora.dropout", ABSENT, 0.1), ("config.lora.r", 16, 8)]
    assert str(error) == ("experiment contract changed: config.lora.dropout: saved (absent), now 0.1; "
                          "config.lora.r: saved 16, now 8; pass allow_contract_change=True to "
                          "restore anyway")
    changes = contract.check(saved.contract, now, allow_change=True, saved_values=saved.contract_values)
    assert set(changes) == {"config"}


def test_a_manifest_without_values_gives_the_field_level_message() -> None:
    saved = manifest_with(contract.Contract(digests={"config": "v1"}))
    assert saved.contract_values is None
    with pytest.raises(ContractMismatch) as caught:
        contract.check(saved.contract, contract.build({"config": "v2"}), allow_change=False,
                       saved_values=saved.contract_values)
    assert str(caught.value) == ("experiment contract changed in field(s): config; pass "
                                 "allow_contract_change=True to restore anyway")
    assert caught.value.fields == {"config": ("v1", "v2")} and caught.value.changes == []


def test_many_changes_are_counted_and_the_line_stays_short() -> None:
    saved = contract.build({"config": {f"key{i}": i for i in range(50)}})
    now = contract.build({"config": {f"key{i}": -i - 1 for i in range(50)}})
    with pytest.raises(ContractMismatch) as caught:
        contract.check(saved.digests, now, allow_change=False, saved_values=saved.values)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300 and " more); pass allow_contract_change" in message
    assert len(caught.value.changes) + caught.value.unlisted == 50


def test_a_generation_of_an_older_version_still_matches_its_value() -> None:
    """An enum's digest was of ``str(Color.RED)``; the same value must not turn into a
    ContractMismatch after an upgrade."""
    saved = {"config": old_digest({"color": Color.RED})}
    assert saved["config"] != contract.normalize({"config": {"color": Color.RED}})["config"]
    assert contract.check(saved, contract.build({"config": {"color": Color.RED}}),
                          allow_change=False) == {}


def test_a_hostile_contract_values_field_is_a_validation_error() -> None:
    raw = manifest_with(contract.build({"c": 1})).to_bytes().replace(
        b'"contract_values": {', b'"contract_values": {"deep": ' + b"[" * 5000 + b"]" * 5000 + b", ", 1)
    with pytest.raises(ValidationError, match="is corrupt"):
        Manifest.from_bytes(raw, generation="gen-000000000001")


def test_a_restore_names_the_changed_key(tmp_path) -> None:
    root = str(tmp_path)

    def state(r: int) -> TrainState:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        return TrainState(model, torch.optim.Adam(model.parameters()),
                          contract={"config": {"lora": {**LORA, "r": r}}})

    first = state(16)
    with CheckpointManager(CheckpointConfig(root=root), first) as mgr:
        step(first)
        mgr.save(1)
    with CheckpointManager(CheckpointConfig(root=root), state(8)) as mgr:
        with pytest.raises(ContractMismatch) as caught:
            mgr.restore()
    assert "config.lora.r: saved 16, now 8" in str(caught.value)


@pytest.mark.processes
def test_a_set_in_the_contract_restores_under_another_hash_seed_on_two_ranks(tmp_path, monkeypatch) -> None:
    # issue 38: fresh interpreters (spawn), so each run's ranks hash strings with the seed given
    from dist_ckpt.testing import START_ENV, run_ranks
    from tests.helpers import disagree_jobs

    root = str(tmp_path / "root")
    monkeypatch.setenv(START_ENV, "spawn")
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert run_ranks(2, disagree_jobs.save_with_a_set, root) == ["1:1", "1:1"]
    for seed in ("2", "3"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        assert run_ranks(2, disagree_jobs.restore_with_a_set, root) == ["gen-000000000001"] * 2
