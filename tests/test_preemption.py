"""Preemption at the library level: the launcher's notice file (written by rank 0 here, as the
launcher would) makes every rank save one agreed update durably and raise ``Preempted``
(2 gloo ranks under a simulated launcher directory)."""

from __future__ import annotations

import os

import pytest
import torch

from dist_ckpt import runinfo
from dist_ckpt.errors import PREEMPTED_EXIT, Preempted
from dist_ckpt.format.validate import list_generations, read_manifest, validate
from dist_ckpt.memory import paths as shm
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.testing import run_ranks
from tests.helpers import preempt_jobs

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]
NOTICE_AT, LIMIT = 4, 400


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_preempted(ranks: list[dict], root: str, launch_dir: str) -> str:
    """Both ranks stopped at the same update after the notice; the generation is committed and
    valid on the root; each rank's report says what it saved."""
    (first, second) = ranks
    assert first["generation"] is not None, f"never preempted in {LIMIT} updates: {first}"
    assert (first["generation"], first["update"]) == (second["generation"], second["update"])
    assert first["code"] == PREEMPTED_EXIT and first["reached"] == second["reached"] == first["update"]
    assert NOTICE_AT < first["update"] < LIMIT
    name = first["generation"]
    store = LocalStore(root)
    assert list_generations(store) == [name]  # save_every never came: only the preemption's
    validate(store, name)
    assert read_manifest(store, name).tokens_seen == preempt_jobs.TOKENS_PER_UPDATE * first["update"]
    reports = runinfo.read_reports(launch_dir)
    assert {r: (rep.get("preempted"), rep.get("preempted_update")) for r, rep in reports.items()} == {
        0: (name, first["update"]), 1: (name, first["update"])}
    return name


@pytest.mark.parametrize("call", ["maybe_save", "heartbeat"])
def test_notice_saves_one_agreed_update_and_a_restore_resumes_there(tmp_path, call: str) -> None:
    root, launch_dir = str(tmp_path / "root"), str(tmp_path / "start")
    ranks = run_ranks(2, preempt_jobs.train_until_preempted, root, launch_dir, NOTICE_AT, LIMIT, call,
                      None, {"async_save": call == "heartbeat"}, timeout_s=180)
    name = check_preempted(ranks, root, launch_dir)
    restored = run_ranks(2, preempt_jobs.restore, root, timeout_s=180)
    assert (restored[0]["generation"], restored[0]["next_update"]) == (name, ranks[0]["update"])
    assert equal(restored[0]["full"], ranks[0]["full"]), "the preempted state did not restore bitwise"


def test_preemption_save_is_not_skipped_for_a_save_in_flight(tmp_path) -> None:
    """in_flight_policy="skip" skips cadence saves that find one in flight (slowed writes make
    every save find one); the preemption's save blocks for it instead."""
    root, launch_dir = str(tmp_path / "root"), str(tmp_path / "start")
    config = {"async_save": True, "in_flight_policy": "skip", "save_every": 1}
    ranks = run_ranks(2, preempt_jobs.train_until_preempted, root, launch_dir, NOTICE_AT, LIMIT,
                      "maybe_save", None, config, {"write.before": {"delay_s": 0.3}}, timeout_s=180)
    first, second = ranks
    assert first["generation"] is not None and first["generation"] == second["generation"]
    assert first["skipped"] > 0, "no save found one in flight: the case is not exercised"
    store = LocalStore(root)
    assert first["generation"] in list_generations(store)
    validate(store, first["generation"])


def test_memory_tier_preemption_is_persisted_to_the_root(tmp_path) -> None:
    root, launch_dir = str(tmp_path / "root"), str(tmp_path / "start")
    memory = (str(tmp_path / "shm"), "t-preempt")
    ranks = run_ranks(2, preempt_jobs.train_until_preempted, root, launch_dir, NOTICE_AT, LIMIT,
                      "maybe_save", memory, {"memory_tier": True, "persist_every": 1000}, timeout_s=180)
    name = check_preempted(ranks, root, launch_dir)
    # the node's memory may not survive a preemption: with it gone, the root alone resumes
    assert os.path.isdir(shm.run_dir(memory[1], root, memory[0]))
    restored = run_ranks(2, preempt_jobs.restore, root, (str(tmp_path / "other-shm"), "t-other"),
                         timeout_s=180)
    assert (restored[0]["generation"], restored[0]["next_update"]) == (name, ranks[0]["update"])
    assert equal(restored[0]["full"], ranks[0]["full"])


def test_preempted_is_a_system_exit_with_its_code() -> None:
    stop = Preempted("gen-000000000007", 7)
    assert isinstance(stop, SystemExit) and not isinstance(stop, Exception)
    assert stop.code == PREEMPTED_EXIT and str(stop) == "preempted: saved gen-000000000007 at update 7"


def test_finish_under_a_notice_writes_done(tmp_path) -> None:
    root, launch_dir = str(tmp_path / "root"), str(tmp_path / "start")
    ranks = run_ranks(2, preempt_jobs.finish_under_notice, root, launch_dir, 3, timeout_s=180)
    assert [r["done"] for r in ranks] == ["gen-000000000003"] * 2 and ranks[0]["preempted"] is None
    assert os.path.exists(os.path.join(root, "DONE.json"))
