"""Fixtures of the fault matrix.

``require_fuse``: the power-loss rows mount a FUSE filesystem (``tests/helpers/powerfs.py``).
Where FUSE is unavailable (no ``/dev/fuse``, no libfuse3, no ``mfusepy``, a mount that fails)
they skip with the reason, unless ``DIST_CKPT_REQUIRE_FUSE=1`` (set by ``scripts/test.sh``
under CI), which turns the skip into a failure so CI proves the rows ran.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.powerfs import PowerFS

REQUIRE_FUSE_ENV = "DIST_CKPT_REQUIRE_FUSE"


def fuse_required() -> bool:
    return os.environ.get(REQUIRE_FUSE_ENV, "").strip().lower() in ("1", "true", "yes")


@pytest.fixture
def require_fuse() -> None:
    ok, reason = PowerFS.available()
    if ok:
        return
    if fuse_required():
        pytest.fail(f"FUSE is unavailable but {REQUIRE_FUSE_ENV}=1: {reason}", pytrace=False)
    pytest.skip(f"FUSE is unavailable: {reason}")
