"""Release export (dist_ckpt.export, `dist-ckpt export`): a generation's model tensors as
safetensors, bitwise equal to the gathered model, loadable into an unsharded model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState, cli
from dist_ckpt.export import INDEX_NAME, RELEASE_NAME, export_generation
from dist_ckpt.testing import run_ranks
from tests.helpers import workers

GEN = "gen-000000000003"


def run_cli(argv: list[str]) -> int:
    return cli.main(argv)


def sha256_file(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def read_release(out: str) -> tuple[dict[str, torch.Tensor], dict, dict]:
    with open(os.path.join(out, INDEX_NAME), encoding="utf-8") as handle:
        index = json.load(handle)
    with open(os.path.join(out, RELEASE_NAME), encoding="utf-8") as handle:
        release = json.load(handle)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(out, name)))
    return tensors, index, release


@pytest.fixture(scope="module")
def fsdp_gen(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    root = str(tmp_path_factory.mktemp("fsdp") / "root")
    results = run_ranks(2, workers.save_for_reshard, "fsdp", root, 3)
    model = {k[len("/model/"):]: v for k, v in results[0]["full"].items() if k.startswith("/model/")}
    return root, model


@pytest.mark.processes
def test_fsdp_generation_exports_bitwise(fsdp_gen, tmp_path) -> None:
    root, model = fsdp_gen
    out = str(tmp_path / "release")
    info = export_generation(root, out)
    tensors, index, release = read_release(out)
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, RELEASE_NAME, "model.safetensors"])
    assert tensors.keys() == model.keys() and info.aliases == {}
    for name, tensor in model.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
    assert tensors["calls"].dtype == torch.int64
    fresh = workers.Net()
    fresh.load_state_dict(tensors, strict=True)
    assert set(index["weight_map"]) == set(model)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.values())
    manifest = os.path.join(root, GEN, "manifest.json")
    assert release["generation"] == GEN and release["manifest_sha256"] == sha256_file(manifest)
    assert release["tensor_count"] == len(model) and info.tensor_count == len(model)
    assert release["files"].keys() == {"model.safetensors", INDEX_NAME}
    for name, entry in release["files"].items():
        assert entry["sha256"] == sha256_file(os.path.join(out, name)), name
        assert entry["size"] == os.path.getsize(os.path.join(out, name))
    assert not any(n.startswith(".release.tmp") for n in os.listdir(tmp_path))


def test_cli_dtype_bf16_casts_floats_only(fsdp_gen, tmp_path, capsys) -> None:
    root, model = fsdp_gen
    out = str(tmp_path / "bf16")
    assert run_cli(["export", root, GEN, "--out", out, "--dtype", "bf16", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["dtype"] == "bf16" and printed["generation"] == GEN
    tensors, index, _ = read_release(out)
    for name, tensor in model.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert tensors[name].dtype == want.dtype and torch.equal(tensors[name], want), name
    assert tensors["calls"].dtype == torch.int64
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_small_shards_weight_map(fsdp_gen, tmp_path) -> None:
    root, model = fsdp_gen
    out = str(tmp_path / "sharded")
    export_generation(root, out, max_shard_bytes=1500)
    tensors, index, release = read_release(out)
    shards = sorted(set(index["weight_map"].values()))
    count = len(shards)
    assert count >= 3
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for name in shards:  # each tensor is in the file the index names, and nowhere else
        with safe_open(os.path.join(out, name), framework="pt") as handle:
            assert set(handle.keys()) == {k for k, v in index["weight_map"].items() if v == name}
        assert release["files"][name]["sha256"] == sha256_file(os.path.join(out, name))
        assert os.path.getsize(os.path.join(out, name)) < 1500 + 4096  # data bound + header
    assert tensors.keys() == model.keys()
    assert all(torch.equal(tensors[k], v) for k, v in model.items())


def test_refuses_to_overwrite(fsdp_gen, tmp_path, capsys) -> None:
    root, _ = fsdp_gen
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run_cli(["export", root, "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(["export", root, "--out", str(empty)]) == 2
    assert run_cli(["export", root, "gen-000000000099", "--out", str(tmp_path / "x")]) == 2


def test_corrupt_source_file_exit_1_names_it(fsdp_gen, tmp_path, capsys) -> None:
    root = str(tmp_path / "root")
    shutil.copytree(fsdp_gen[0], root)
    dcp_dir = os.path.join(root, GEN, "dcp")
    victim = sorted(n for n in os.listdir(dcp_dir) if n.endswith(".distcp"))[-1]
    with open(os.path.join(dcp_dir, victim), "r+b") as handle:  # same size, other bytes
        handle.seek(200)
        byte = handle.read(1)
        handle.seek(200)
        handle.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out"
    assert run_cli(["export", root, "--out", str(out)]) == 1
    assert f"dcp/{victim}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["root"]  # no output, no temporary left behind


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        torch.nn.init.zeros_(self.a.bias)  # equal but not tied: both must be written
        torch.nn.init.zeros_(self.b.bias)
        self.register_buffer("mask", torch.tensor([True, False, True]))


def test_tied_weight_written_once(tmp_path) -> None:
    root, out = str(tmp_path / "root"), str(tmp_path / "out")
    torch.manual_seed(0)
    model = Tied()
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), contract={"c": "1"})
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        mgr.save(1)
    info = export_generation(root, out)
    tensors, index, release = read_release(out)
    assert info.aliases == release["aliases"] == {"head.weight": "emb.weight"}
    assert "head.weight" not in tensors and "head.weight" not in index["weight_map"]
    assert {"a.bias", "b.bias"} <= tensors.keys() and tensors["mask"].dtype == torch.bool
    for alias, canonical in release["aliases"].items():
        tensors[alias] = tensors[canonical]
    fresh = Tied()
    fresh.load_state_dict(tensors, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_export_from_object_store(s3_root, tmp_path) -> None:
    torch.manual_seed(0)
    model = Tied()
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), contract={"c": "1"})
    with CheckpointManager(CheckpointConfig(root=s3_root, cache_dir=str(tmp_path / "cache")), state) as mgr:
        mgr.save(1)
    out = str(tmp_path / "out")
    info = export_generation(s3_root, out, "gen-000000000001", cache_dir=str(tmp_path / "scratch"))
    tensors, _, release = read_release(out)
    assert info.aliases == {"head.weight": "emb.weight"} and release["source_root"] == s3_root
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensors[release["aliases"].get(name, name)], tensor), name
    assert os.listdir(tmp_path / "scratch") == []  # verified local copies are removed


def test_export_of_a_root_says_which_newer_generation_it_passed_over(tmp_path, capsys) -> None:
    """Issue 40 item 8: as inspect and verify do, in the same words."""
    from tests.helpers.local_jobs import two_generations

    root, out = str(tmp_path / "root"), str(tmp_path / "out")
    two_generations(root)
    broken = os.path.join(root, "gen-000000000003")
    shutil.copytree(os.path.join(root, "gen-000000000002"), broken)
    with open(os.path.join(broken, "manifest.json"), "w") as handle:
        handle.write("{")  # torn: not a committed generation
    assert cli.main(["export", root, "--out", out]) == 0
    captured = capsys.readouterr()
    assert "note: newer gen-000000000003 not committed or invalid; using gen-000000000002" in captured.err
    assert "exported gen-000000000002" in captured.out
    assert json.load(open(os.path.join(out, RELEASE_NAME)))["generation"] == "gen-000000000002"
