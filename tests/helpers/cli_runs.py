"""What the CLI tests share: a private copy of a template root, a CLI call with its output,
and a damaged byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dist_ckpt.cli.app import main


def private_copy(template: Path, tmp_path: Path) -> Path:
    """A copy of the template root under this test's directory, free to damage."""
    dest = tmp_path / "ckpt"
    shutil.copytree(template, dest)
    return dest


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``dist-ckpt ARGV`` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
