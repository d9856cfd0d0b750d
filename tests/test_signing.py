"""Keyed manifest signatures: a consistent forgery is accepted without a key and refused
with one; unsigned and wrongly keyed generations are refused; object stores sign too."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, ConfigError, NoValidGeneration
from dist_ckpt.cli.app import main as cli
from dist_ckpt.digests import digest_bytes
from dist_ckpt.format.manifest import GLOBAL_STATE_FILE, FileEntry, Manifest
from dist_ckpt.format.signing import KEY_ENV
from tests.helpers.local_jobs import make_state, step, two_generations

KEY = "job-secret-0123456789abcdef"


def forge(root: str, generation: str) -> None:
    """What someone who can write the root can do: change a file, then fix up the manifest."""
    folder = os.path.join(root, generation)
    path = os.path.join(folder, GLOBAL_STATE_FILE)
    with open(path, "rb") as handle:
        state = json.loads(handle.read())
    state["tokens_seen"] = 10**12
    forged = json.dumps(state).encode()
    with open(path, "wb") as handle:
        handle.write(forged)
    manifest_path = os.path.join(folder, "manifest.json")
    with open(manifest_path, "rb") as handle:
        manifest = Manifest.from_bytes(handle.read(), generation=generation)
    files = [FileEntry.of(f.path, len(forged), f.algorithm, digest_bytes(forged, f.algorithm), f.rank)
             if f.path == GLOBAL_STATE_FILE else f for f in manifest.files]
    with open(manifest_path, "wb") as handle:
        handle.write(manifest.model_copy(update={"files": files}).to_bytes())


def restore(root: str, **config) -> tuple[str | None, list[str]]:
    """Restore, starting over when every generation is rejected (the explicit choice: the
    default raises ``NoValidGeneration``, test_unsigned_and_wrong_key_are_refused)."""
    with CheckpointManager(CheckpointConfig(root=root, **config), make_state()) as mgr:
        result = mgr.restore(on_all_rejected="fresh")
    return result.generation, [str(p) for p in result.rejected]


def test_forged_manifest_is_refused_only_with_a_key(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    two_generations(root, hmac_key=KEY)
    assert sorted(os.listdir(os.path.join(root, "gen-000000000002")))[:2] == ["dcp", "manifest.json"]
    assert os.path.exists(os.path.join(root, "gen-000000000002", "manifest.sig"))
    assert restore(root, hmac_key=KEY) == ("gen-000000000002", [])
    forge(root, "gen-000000000002")
    # digests alone cannot tell: the forgery is self-consistent
    assert restore(root)[0] == "gen-000000000002"
    assert cli(["verify", root, "gen-000000000002"]) == 0
    # the key can: the newest is refused by name and reason, the previous one restores
    generation, rejected = restore(root, hmac_key=KEY)
    assert generation == "gen-000000000001"
    assert len(rejected) == 1 and "gen-000000000002" in rejected[0]
    assert "manifest changed after signing" in rejected[0] and "manifest.sig" in rejected[0]
    monkeypatch.setenv(KEY_ENV, KEY)
    assert cli(["verify", root, "gen-000000000002"]) == 1
    assert cli(["verify", root, "gen-000000000001"]) == 0
    assert restore(root)[0] == "gen-000000000001"  # the key from the environment


def test_unsigned_and_wrong_key_are_refused(tmp_path) -> None:
    unsigned, signed = str(tmp_path / "unsigned"), str(tmp_path / "signed")
    two_generations(unsigned)
    generation, rejected = restore(unsigned, hmac_key=KEY)
    assert generation is None and len(rejected) == 2
    with CheckpointManager(CheckpointConfig(root=unsigned, hmac_key=KEY), make_state()) as mgr:
        with pytest.raises(NoValidGeneration, match="is not signed"):
            mgr.restore()  # without the explicit choice: never a silent fresh start
    assert all("not signed" in reason for reason in rejected)
    two_generations(signed, hmac_key=KEY)
    generation, rejected = restore(signed, hmac_key="another-key-0123456789")
    assert generation is None and all("signed with another key" in r for r in rejected)


def test_short_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="hmac_key"):
        CheckpointConfig(root="/tmp/x", hmac_key="short")
    assert KEY not in repr(CheckpointConfig(root="/tmp/x", hmac_key=KEY))


def test_object_store_generations_are_signed(s3_root: str, tmp_path, monkeypatch) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=s3_root, cache_dir=str(tmp_path), hmac_key=KEY),
                           state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
    assert restore(s3_root, hmac_key=KEY)[0] == "gen-000000000002"
    assert restore(s3_root, hmac_key="another-key-0123456789")[0] is None
    monkeypatch.setenv(KEY_ENV, KEY)
    assert cli(["verify", s3_root]) == 0


def test_mirror_generations_are_signed(s3_root: str, tmp_path) -> None:
    state = make_state()
    config = CheckpointConfig(root=str(tmp_path), mirror=s3_root, hmac_key=KEY)
    with CheckpointManager(config, state) as mgr:
        step(state)
        mgr.save(1)
    assert os.path.exists(tmp_path / "gen-000000000001" / "manifest.sig")
    assert restore(s3_root, hmac_key=KEY)[0] == "gen-000000000001"  # the mirror alone
    assert restore(s3_root, hmac_key="another-key-0123456789")[0] is None


def test_malformed_signature_is_a_rejection_not_a_crash(tmp_path) -> None:
    root = str(tmp_path)
    two_generations(root, hmac_key=KEY)
    with open(os.path.join(root, "gen-000000000002", "manifest.sig"), "w") as handle:
        handle.write(json.dumps({"alg": "hmac-sha256", "mac": "é" * 64}))
    generation, rejected = restore(root, hmac_key=KEY)
    assert generation == "gen-000000000001"
    assert "manifest.sig is unreadable" in rejected[0]


def test_forged_manifests_do_not_push_real_generations_out(tmp_path) -> None:
    root = str(tmp_path)
    state = make_state()
    config = CheckpointConfig(root=root, hmac_key=KEY, keep_last=2)
    with CheckpointManager(config, state) as mgr:
        for update in (1, 2):
            step(state)
            mgr.save(update)
        for forged in (100, 101):  # unsigned copies with higher numbers, planted by a writer
            name = f"gen-{forged:012d}"
            shutil.copytree(os.path.join(root, "gen-000000000002"), os.path.join(root, name))
            os.unlink(os.path.join(root, name, "manifest.sig"))
            path = os.path.join(root, name, "manifest.json")
            with open(path, "rb") as handle:
                manifest = Manifest.from_bytes(handle.read(), generation="gen-000000000002")
            with open(path, "wb") as handle:
                handle.write(manifest.model_copy(update={"generation": name,
                                                         "next_update": forged}).to_bytes())
        step(state)
        mgr.save(3)
        mgr.pruner.settle()  # the prune queued by this save ran
    names = sorted(n for n in os.listdir(root) if n.startswith("gen-"))
    # the real newest two stay; the forgeries are neither counted nor deleted
    assert names == ["gen-000000000002", "gen-000000000003", "gen-000000000100", "gen-000000000101"]
    assert restore(root, hmac_key=KEY)[0] == "gen-000000000003"
