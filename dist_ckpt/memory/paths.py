"""Where the memory tier lives on a node: ``/dev/shm/dist_ckpt-<run id>/``.

POSIX shared memory on Linux is the tmpfs mounted at ``/dev/shm``: a directory there holds
the in-memory generations of one run on one node (the memory tier, ``memory/tier.py``), and
its bytes stay in RAM after the worker that wrote them dies. ``DIST_CKPT_SHM_DIR`` moves the
base directory (tests use a private one).

Ownership belongs to the node's launcher (``launch/memory_dir.py``, through
``dist_ckpt.launcher_api``): it claims its run's directory when it starts, removes it when it
stops and removes the directories of dead launchers. Workers only create the directory when
it is missing (outside the launcher nobody removes it: the memory tier requires the
launcher's run id for that reason).

Call order: any worker, and the launcher, any time.
"""

from __future__ import annotations

import os
import re

SHM_DIR_ENV = "DIST_CKPT_SHM_DIR"
DEFAULT_BASE = "/dev/shm"
PREFIX = "dist_ckpt-"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def base_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_BASE


def valid_run_id(run_id: str) -> bool:
    """A run id that names one directory (never a path)."""
    return bool(_RUN_ID.match(run_id)) and run_id not in (".", "..")


def run_dir(run_id: str, base: str | None = None) -> str:
    if not valid_run_id(run_id):
        raise ValueError(f"run id {run_id!r} cannot name a shared-memory directory")
    return os.path.join(base or base_dir(), PREFIX + run_id)
