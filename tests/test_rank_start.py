"""How ``dist_ckpt.testing`` starts ranks: forked from a fork server that imported torch once,
yet each rank sees its caller's environment and working directory as of the call, not the
server's from when it started (``rank_context``, ``enter_rank``)."""

from __future__ import annotations

import os

import pytest

from dist_ckpt.testing import START_ENV, run_ranks
from tests.helpers import workers

pytestmark = pytest.mark.processes
NAME = "DIST_CKPT_TEST_RANK_START_PROBE"


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_and_directory_now(tmp_path, monkeypatch, method: str) -> None:
    monkeypatch.setenv(START_ENV, method)
    # twice: a fork server started by the first call must hand the second call's environment
    # on; a spawned rank is a fresh interpreter each time, so once shows it
    calls = (("first", tmp_path / "a"), ("second", tmp_path / "b"))
    for value, directory in calls if method == "forkserver" else calls[:1]:
        directory.mkdir()
        monkeypatch.setenv(NAME, value)
        monkeypatch.chdir(directory)
        ranks = run_ranks(2, workers.environment_and_cwd, NAME)
        assert [(seen, cwd) for seen, cwd, _ in ranks] == [(value, str(directory))] * 2
        assert len({pid for _, _, pid in ranks} | {os.getpid()}) == 3  # processes of their own
