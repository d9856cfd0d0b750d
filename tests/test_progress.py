"""Progress bars: bytes and rate when enabled, nothing at all otherwise."""

from __future__ import annotations

from dist_ckpt import progress
from dist_ckpt.cli.app import main as cli
from tests.helpers.local_jobs import two_generations


def test_bar_counts_bytes_only_when_enabled(capsys) -> None:
    with progress.bar("verify", enabled=True, total=3 << 20):
        progress.advance(1 << 20)
        progress.advance(2 << 20)
    shown = capsys.readouterr().err
    assert "verify" in shown and "/3.00M" in shown and "B/s" in shown
    with progress.bar("verify", enabled=False):
        progress.advance(1 << 20)
    progress.advance(1 << 20)  # outside any bar: a no-op
    assert capsys.readouterr().err == ""


def test_cli_shows_no_bar_off_a_terminal(tmp_path, capsys) -> None:
    root = str(tmp_path)
    two_generations(root)
    assert cli(["verify", root, "--all", "--json"]) == 0
    assert cli(["verify", root, "--all"]) == 0
    assert "it/s" not in capsys.readouterr().err and "B/s" not in capsys.readouterr().err
