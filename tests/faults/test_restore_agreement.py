"""Ranks that disagree at restore: one rank of three refuses alone (a changed contract, a model
of another shape, a read that fails), and every rank ends with the same error within seconds
instead of the others waiting in a collective of the load until the group's timeout."""

from __future__ import annotations

import pytest

from dist_ckpt.testing import run_ranks
from tests.helpers import disagree_jobs
from tests.helpers.matrix import record

EXPECTED = {"contract": ("ContractRefused", "ContractMismatch", "config.lora.r"),
            "shape": ("LayoutRefused", "LayoutMismatch", "does not fit"),
            "read": ("RestoreRefused", "FaultInjected", "restore.read")}


@pytest.mark.processes
@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_rank_refusing_alone_ends_restore_on_every_rank(tmp_path, case: str) -> None:
    results = run_ranks(3, disagree_jobs.save_then_disagree, str(tmp_path / "root"), case,
                        timeout_s=90)
    error, kind, detail = EXPECTED[case]
    refusing = disagree_jobs.REFUSING_RANK[case]
    assert {r["error"] for r in results} == {error}, results
    assert len({r["message"] for r in results}) == 1, "every rank raises the same error"
    message = results[0]["message"]
    assert f"refused on rank(s) {refusing} " in message and kind in message and detail in message
    assert all("RestoreRefused" in r["classes"] for r in results)
    if case != "read":  # the mismatch class still catches it, on every rank
        assert all(kind in r["classes"] for r in results)
    slowest = max(r["seconds"] for r in results)
    assert slowest < 10, f"restore ended after {slowest:.1f} s on some rank"
    record("ranks disagree at restore", observed=f"{case}: every rank raised {error} ({message[:160]})",
           detect_s=round(slowest, 2))
