"""Digest algorithms: new generations record BLAKE3; sha256 generations (format 1, written
before BLAKE3, or with ``digest_algorithm="sha256"``) still verify and restore."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, ConfigError
from dist_ckpt.cli.app import main as cli
from dist_ckpt.digests import digest_bytes
from dist_ckpt.format.manifest import MANIFEST_NAME, FileEntry
from tests.helpers.local_jobs import assert_same_model, load_with_plain_dcp, make_state, two_generations

GEN2 = "gen-000000000002"


def manifest_doc(root: str, generation: str = GEN2) -> dict:
    with open(os.path.join(root, generation, MANIFEST_NAME), "rb") as handle:
        return json.loads(handle.read())


def restored_tensors(root: str) -> tuple[str | None, dict[str, torch.Tensor]]:
    state = make_state()
    with torch.no_grad():
        for param in state.model.parameters():
            param.zero_()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        result = mgr.restore()
    return result.generation, {k: v.clone() for k, v in state.model.state_dict().items()}


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_every_entry_records_its_algorithm_and_true_digest(tmp_path, algorithm: str) -> None:
    root = str(tmp_path)
    two_generations(root, digest_algorithm=algorithm)
    doc = manifest_doc(root)
    assert doc["format_version"] == 2
    other = "sha256" if algorithm == "blake3" else "blake3"
    for entry in doc["files"]:
        assert other not in entry, entry
        with open(os.path.join(root, GEN2, entry["path"]), "rb") as handle:
            assert digest_bytes(handle.read(), algorithm) == entry[algorithm], entry["path"]
    assert cli(["verify", root, GEN2]) == 0


def test_a_format_1_sha256_generation_restores(tmp_path) -> None:
    """What dist_ckpt wrote before BLAKE3: format 1, sha256 entries."""
    root = str(tmp_path)
    saved = two_generations(root, digest_algorithm="sha256")
    doc = manifest_doc(root)
    doc["format_version"] = 1
    with open(os.path.join(root, GEN2, MANIFEST_NAME), "w") as handle:
        json.dump(doc, handle)
    assert cli(["verify", root, GEN2]) == 0
    generation, tensors = restored_tensors(root)
    assert generation == GEN2
    for name, value in saved.model.state_dict().items():
        assert torch.equal(tensors[name], value), name


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_a_flipped_byte_is_caught_whatever_the_algorithm(tmp_path, algorithm: str) -> None:
    root = str(tmp_path)
    two_generations(root, digest_algorithm=algorithm)
    shard = next(e["path"] for e in manifest_doc(root)["files"] if e["path"].endswith(".distcp"))
    path = os.path.join(root, GEN2, shard)
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    assert cli(["verify", root, GEN2]) == 1
    generation, _ = restored_tensors(root)
    assert generation == "gen-000000000001"


def test_an_entry_needs_exactly_one_digest() -> None:
    digest = "0" * 64
    with pytest.raises(ValueError, match="exactly one digest"):
        FileEntry(path="a", size=1, rank=0)
    with pytest.raises(ValueError, match="exactly one digest"):
        FileEntry(path="a", size=1, rank=0, sha256=digest, blake3=digest)
    assert FileEntry.of("a", 1, "blake3", digest, 0).algorithm == "blake3"


def test_unknown_algorithm_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="digest_algorithm"):
        CheckpointConfig(root=str(tmp_path), digest_algorithm="md5")


def test_restore_reads_and_hashes_each_shard_once_in_the_load(tmp_path, monkeypatch) -> None:
    """Selection hashes the small files only; the load maps each shard once, hashes it there,
    and DCP deserialises from that same mapping."""
    from dist_ckpt.restore import onepass
    from dist_ckpt.storage.local import LocalStore

    root = str(tmp_path)
    saved = two_generations(root)
    selection_hashed: list[str] = []
    original_digest = LocalStore.digest

    def spy_digest(self, rel: str, algorithm: str) -> str:
        selection_hashed.append(rel)
        return original_digest(self, rel, algorithm)

    fetched: list[str] = []
    original_fetch = onepass.OnePassReader._fetch

    def spy_fetch(self, rel: str):
        fetched.append(rel)
        return original_fetch(self, rel)

    hashed: list[int] = []
    original_close = onepass.OnePassReader.close

    def spy_close(self) -> None:
        hashed.append(self.hashed_bytes)
        original_close(self)

    monkeypatch.setattr(LocalStore, "digest", spy_digest)
    monkeypatch.setattr(onepass.OnePassReader, "_fetch", spy_fetch)
    monkeypatch.setattr(onepass.OnePassReader, "close", spy_close)
    generation, tensors = restored_tensors(root)
    assert generation == GEN2
    shards = {e["path"]: e["size"] for e in manifest_doc(root)["files"] if e["path"].endswith(".distcp")}
    assert not [rel for rel in selection_hashed if rel.endswith(".distcp")], selection_hashed
    assert sorted(f"dcp/{rel}" for rel in fetched) == sorted(shards)  # each shard once
    assert hashed == [sum(shards.values())]
    for name, value in saved.model.state_dict().items():
        assert torch.equal(tensors[name], value), name


def test_a_shard_failing_in_the_load_leaves_no_tensor_of_it(tmp_path) -> None:
    """The digest is checked before DCP copies a byte: the older generation restores whole."""
    root = str(tmp_path)
    state = make_state()
    older: dict[str, torch.Tensor] = {}
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        for update in (1, 2):
            with torch.no_grad():
                for param in state.model.parameters():
                    param.fill_(float(update))
            mgr.save(update)
            if update == 1:
                older = {k: v.clone() for k, v in state.model.state_dict().items()}
    shard = next(e["path"] for e in manifest_doc(root)["files"] if e["path"].endswith(".distcp"))
    path = os.path.join(root, GEN2, shard)
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x80]))
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        result = mgr.restore()
    assert result.generation == "gen-000000000001"
    assert [p.generation for p in result.rejected] == [GEN2]
    assert shard in str(result.rejected[0])
    for name, value in state.model.state_dict().items():
        assert torch.equal(value, older[name]), name


def test_a_generation_loads_with_plain_dcp_and_crc_is_restored(tmp_path) -> None:
    """Shards are written without the zip CRC32 (the digest covers them); plain
    ``dcp.load`` still reads them, and torch's own setting is back once the save is done."""
    from torch.utils.serialization import config as serialization_config

    root = str(tmp_path)
    before = serialization_config.save.compute_crc32
    saved = two_generations(root)
    assert serialization_config.save.compute_crc32 == before
    fresh = make_state()
    load_with_plain_dcp(os.path.join(root, GEN2, "dcp"), fresh)
    assert_same_model(fresh, saved)
    for mine, theirs in zip(fresh.optimizer.state.values(), saved.optimizer.state.values(), strict=True):
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))
