"""What the CLI tests share: a private copy of a template root, a CLI call with its output,
and a damaged byte."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dist_ckpt.cli.app import main


def private_copy(template: Path, tmp_path: Path) -> Path:
    """A copy of the template root under this test's directory, free to damage."""
    dest = tmp_path / "ckpt"
    shutil.copytree(template, dest)
    return dest


def two_generation_roots(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A module's ``template`` fixture (gen-1 and gen-2 of the tiny job, saved once per module;
    latest.json -> gen-2) and ``root`` fixture (a private copy of it per test, free to
    damage): ``template, root = two_generation_roots("ops-template")``."""
    from tests.helpers.local_jobs import two_generations

    @pytest.fixture(scope="module")
    def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
        root = tmp_path_factory.mktemp(name)
        two_generations(str(root))
        return root

    @pytest.fixture
    def root(template: Path, tmp_path: Path) -> Path:
        return private_copy(template, tmp_path)

    return template, root


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``dist-ckpt ARGV`` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
