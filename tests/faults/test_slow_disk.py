"""A disk that stays slow: rank 1's every write request takes seconds, from the middle of an
earlier save on, for the rest of the run (2 gloo ranks, ``block`` policy). Each save fails at
its deadline, the slow rank abandons the doomed generation's remaining writes at once, and
training waits at most about ``commit_timeout_s`` plus one write request per save."""

from __future__ import annotations

import pytest

from dist_ckpt.testing import run_ranks
from tests.helpers import fault_jobs
from tests.helpers.matrix import record

pytestmark = pytest.mark.processes

DEADLINE_S = 3.0
REQUEST_DELAY_S = 1.0
SAVES = 3


def test_slow_disk_fails_each_save_at_its_deadline(tmp_path) -> None:
    ranks = run_ranks(2, fault_jobs.slow_disk, str(tmp_path), DEADLINE_S, REQUEST_DELAY_S, SAVES,
                      timeout_s=240)
    bound = DEADLINE_S + 2 * REQUEST_DELAY_S + 5.0  # the deadline, the request in progress, slack
    for rank, result in enumerate(ranks):
        assert max(result["held"]) < bound, (rank, result["held"])
        # every generation the slow rank wrote after the slowness began failed, on every rank
        assert result["failed"] == ranks[0]["failed"] and len(result["failed"]) >= SAVES - 1
    assert all(name not in ranks[0]["committed"] for name in ranks[0]["failed"])
    record("slow disk that stays slow", observed=f"{len(ranks[0]['failed'])} of {SAVES} saves failed at "
           f"the deadline; longest hold {max(max(r['held']) for r in ranks):.1f} s "
           f"(bound {bound:.0f} s)", detect_s=DEADLINE_S, recover_s=round(max(ranks[1]["held"]), 2))
