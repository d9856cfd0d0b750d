"""A permanent refusal under the launcher prints one line from rank 0, not a traceback from
every rank (issue 38); any other uncaught error keeps Python's traceback."""

from __future__ import annotations

import sys

import pytest

from dist_ckpt import runinfo
from dist_ckpt.errors import ContractMismatch, StorageError


@pytest.fixture
def under_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv(runinfo.LAUNCH_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    yield tmp_path


@pytest.mark.parametrize("rank", [0, 1])
def test_an_uncaught_refusal_is_one_line_on_rank_0(under_launcher, capsys, rank: int) -> None:
    refusal = ContractMismatch({"config": ("sha256:a", "sha256:b")})
    runinfo.report_failure(refusal, rank)
    sys.excepthook(type(refusal), refusal, None)
    err = capsys.readouterr().err
    if rank == 0:
        assert err.splitlines() == [f"[dist_ckpt] rank 0: ContractMismatch: {refusal}"]
    else:
        assert err == ""
    report = runinfo.read_report(runinfo.report_path(str(under_launcher), rank))
    assert report is not None and report["failure"]["permanent"] is True


def test_other_errors_keep_their_traceback(under_launcher, capsys) -> None:
    refusal = ContractMismatch({"config": ("a", "b")})
    runinfo.report_failure(refusal, 0)
    other = StorageError("disk gone")
    try:
        raise other
    except StorageError:
        sys.excepthook(*sys.exc_info())
    err = capsys.readouterr().err
    assert "Traceback" in err and "StorageError: disk gone" in err and "[dist_ckpt]" not in err


def test_outside_the_launcher_nothing_is_hooked(monkeypatch) -> None:
    monkeypatch.delenv(runinfo.LAUNCH_DIR_ENV, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    runinfo.report_failure(ContractMismatch({"config": ("a", "b")}), 0)
    assert sys.excepthook is sys.__excepthook__
