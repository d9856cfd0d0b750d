"""``finish()`` and DONE, ``maybe_save`` cadences, launcher reports, and moving rejected
generations aside so that the job can save their update numbers again."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from dist_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    ConfigError,
    ContractMismatch,
    NoValidGeneration,
    UntrustedGenerations,
)
from dist_ckpt.cli.app import main as cli
from dist_ckpt.format.manifest import MANIFEST_NAME, FileEntry, Manifest, generation_name, rank_state_file
from dist_ckpt.lifecycle.done import check_done
from dist_ckpt.lifecycle.finish import holds_committed
from dist_ckpt.protocol.comm import Comm
from dist_ckpt.restart.contract import digest
from dist_ckpt.runinfo import LAUNCH_DIR_ENV, read_reports
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.testing import run_ranks
from dist_ckpt.tiers.rename import RenameTier
from tests.helpers.local_jobs import make_state, step, two_generations

KEY = "job-secret-0123456789abcdef"


def train_and_finish(root: str, updates: int, contract: dict | None = None) -> None:
    state = make_state(contract)
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        resumed = mgr.restore()
        for update in range(resumed.next_update, updates):
            step(state)
            if update + 1 < updates:
                mgr.save(update + 1)
        mgr.finish(updates, tokens_seen=updates * 10)


def test_finish_writes_a_done_bound_to_the_contract(tmp_path) -> None:
    root = str(tmp_path)
    train_and_finish(root, 3)
    done = json.load(open(tmp_path / "DONE.json"))
    assert done["generation"] == "gen-000000000003" and done["tokens_seen"] == 30
    contract = make_state().contract
    record, why = check_done(LocalStore(root), contract_digest=digest(contract))
    assert record is not None and why == ""
    record, why = check_done(LocalStore(root), contract_digest=digest({"config": "v2"}))
    assert record is None and "stale" in why
    # a restart after the final save finds it committed and writes DONE again, no GenerationExists
    os.unlink(tmp_path / "DONE.json")
    train_and_finish(root, 3)
    assert json.load(open(tmp_path / "DONE.json"))["manifest_sha256"] == done["manifest_sha256"]


def test_done_is_not_accepted_once_its_generation_is_damaged(tmp_path) -> None:
    root = str(tmp_path)
    train_and_finish(root, 2)
    shard = tmp_path / "gen-000000000002" / "state" / "train_state.json"
    shard.write_bytes(shard.read_bytes()[:-3])
    record, why = check_done(LocalStore(root), contract_digest=digest(make_state().contract))
    assert record is None and "incomplete" in why and "train_state.json" in why


def cadence_ranks(rank: int, world: int, root: str, cadence: str, mtbf_s: float) -> list[int]:
    state = make_state()
    config = CheckpointConfig(root=root, save_every=2, cadence=cadence, mtbf_s=mtbf_s)
    saved = []
    with CheckpointManager(config, state) as mgr:
        for update in range(1, 9):
            step(state)
            if mgr.maybe_save(update) is not None:
                saved.append(update)
    return saved


@pytest.mark.parametrize(("cadence", "mtbf_s", "expected"), [
    ("fixed", 3600.0, [2, 4, 6, 8]),
    ("auto", 1e-9, [2, 3, 4, 5, 6, 7, 8]),  # T* far below one step: every update
    ("auto", 1e12, [2]),  # T* of years: nothing after the first save
])
@pytest.mark.processes
def test_maybe_save_cadence_agreed_across_ranks(tmp_path, cadence: str, mtbf_s: float,
                                                expected: list[int]) -> None:
    saved = run_ranks(2, cadence_ranks, str(tmp_path), cadence, mtbf_s)
    assert saved == [expected, expected]


def test_fixed_cadence_keeps_its_multiples_after_a_restart(tmp_path) -> None:
    root = str(tmp_path)
    config = CheckpointConfig(root=root, save_every=4)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        step(state)
        mgr.save(6)  # e.g. a final save of an earlier, shorter run
    state = make_state()
    with CheckpointManager(config, state) as mgr:
        assert mgr.restore().next_update == 6
        saved = [u for u in range(7, 13) if step(state) or mgr.maybe_save(u) is not None]
    assert saved == [8, 12]


def test_maybe_save_needs_an_interval(tmp_path) -> None:
    with CheckpointManager(CheckpointConfig(root=str(tmp_path)), make_state()) as mgr:
        with pytest.raises(ConfigError, match="save_every"):
            mgr.maybe_save(1)
    with pytest.raises(ConfigError, match="save_every"):
        CheckpointConfig(root=str(tmp_path), cadence="auto")


def test_a_key_that_rejects_everything_raises_under_the_launcher(tmp_path, monkeypatch) -> None:
    root = str(tmp_path / "root")
    two_generations(root, hmac_key=KEY)
    wrong = "another-key-0123456789abcdef"
    with CheckpointManager(CheckpointConfig(root=root, hmac_key=wrong), make_state()) as mgr:
        with pytest.raises(NoValidGeneration, match="signed with another key"):
            mgr.restore()  # issue 38: never a silent fresh start, for a library user either
    with CheckpointManager(CheckpointConfig(root=root, hmac_key=wrong, on_key_rejects_all="fresh"),
                           make_state()) as mgr:
        assert mgr.restore().fresh  # starting over is the user's explicit choice
    with CheckpointManager(CheckpointConfig(root=root, hmac_key=wrong, on_key_rejects_all="raise"),
                           make_state()) as mgr:
        with pytest.raises(UntrustedGenerations, match="rejects every generation"):
            mgr.restore()
    reports = tmp_path / "reports"
    monkeypatch.setenv(LAUNCH_DIR_ENV, str(reports))
    with CheckpointManager(CheckpointConfig(root=root, hmac_key=wrong), make_state()) as mgr:
        with pytest.raises(UntrustedGenerations):
            mgr.restore()
    failure = read_reports(str(reports))[0]["failure"]
    assert failure["permanent"] and failure["error"] == "UntrustedGenerations"
    assert sorted(os.listdir(root))[:2] == ["gen-000000000001", "gen-000000000002"]


def test_permanent_errors_are_reported_to_the_launcher(tmp_path, monkeypatch) -> None:
    root, reports = str(tmp_path / "root"), tmp_path / "reports"
    two_generations(root)
    monkeypatch.setenv(LAUNCH_DIR_ENV, str(reports))
    with pytest.raises(ConfigError):
        CheckpointConfig(root=root, keep_last=0)
    assert read_reports(str(reports))[0]["failure"]["error"] == "ConfigError"
    with CheckpointManager(CheckpointConfig(root=root), make_state({"config": "v2"})) as mgr:
        report = read_reports(str(reports))[0]
        assert report["root"] == root and report["contract_digest"].startswith("sha256:")
        with pytest.raises(ContractMismatch):
            mgr.restore()
    failure = read_reports(str(reports))[0]["failure"]
    assert failure["permanent"] and failure["error"] == "ContractMismatch"


def test_a_rejected_newer_generation_is_moved_aside_and_saved_again(tmp_path, capsys) -> None:
    root = str(tmp_path)
    two_generations(root)
    shard = tmp_path / "gen-000000000002" / "dcp" / "__0_0.distcp"
    damaged = shard.read_bytes()[:-7]
    shard.write_bytes(damaged)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        result = mgr.restore()
        assert result.generation == "gen-000000000001"
        (moved,) = os.listdir(tmp_path / "rejected")
        assert moved.startswith("gen-000000000002-")
        kept = tmp_path / "rejected" / moved
        assert (kept / "dcp" / "__0_0.distcp").read_bytes() == damaged  # evidence kept as it was
        assert "gen-000000000002" in (kept / "reason.txt").read_text()
        step(state)
        mgr.save(2)  # the same update number again: no GenerationExists
    assert [g.name for g in mgr.generations() if g.state == "committed"] == [
        "gen-000000000002", "gen-000000000001"]
    assert cli(["ls", root]) == 0
    listing = capsys.readouterr().out
    assert f"rejected/{moved}" in listing and "quarantined" in listing


def test_a_copy_per_node_is_committed_when_it_holds_its_ranks_files(tmp_path) -> None:
    """``final_step``'s check on a tier with one copy per node: this node's copy of a 2-rank
    generation lacks rank 1's files (another node holds them) and still counts as committed
    for the ranks it serves, never for a node that must hold them all."""
    root = str(tmp_path / "root")
    train_and_finish(root, 1)
    name = generation_name(1)
    store = LocalStore(root)
    manifest = Manifest.from_bytes(store.read_bytes(f"{name}/{MANIFEST_NAME}"), generation=name)
    elsewhere = [FileEntry.of(rank_state_file(1), 10, "sha256", "0" * 64, 1),
                 FileEntry.of("dcp/__1_0.distcp", 10, "sha256", "0" * 64, 1)]
    two_ranks = manifest.model_copy(update={"world_size": 2, "files": [*manifest.files, *elsewhere]})
    with open(os.path.join(root, name, MANIFEST_NAME), "wb") as handle:
        handle.write(two_ranks.to_bytes())
    ctx = SimpleNamespace(comm=Comm(), config=SimpleNamespace(signing_key=None))
    assert holds_committed(ctx, RenameTier(root, frozenset({0})), name, 0)
    assert not holds_committed(ctx, RenameTier(root, frozenset({0, 1})), name, 0)
    assert not holds_committed(ctx, RenameTier(root), name, 0)  # one copy: every file
