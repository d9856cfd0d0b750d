"""Object-store generations across ranks: FSDP2 save at 2 ranks, restore at 3."""

from __future__ import annotations

import pytest

from dist_ckpt.cli.app import main as cli
from dist_ckpt.testing import run_ranks
from tests.helpers import workers
from tests.helpers.workers import check_restart

pytestmark = pytest.mark.processes


def test_fsdp_round_trip_through_s3_two_to_three(s3_root: str) -> None:
    saved = run_ranks(2, workers.save_for_reshard, "fsdp", s3_root, 6)
    loaded = run_ranks(3, workers.load_resharded, "fsdp", s3_root)
    check_restart(saved[0], loaded, old_world=2, steps=6)
    assert cli(["verify", s3_root]) == 0
