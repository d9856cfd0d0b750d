"""Where the memory tier lives on a node: ``<shm base>/dist_ckpt-<run id>-<root digest>/``.

POSIX shared memory on Linux is the tmpfs mounted at ``/dev/shm``: a directory there holds
the in-memory generations of one job on one node (the memory tier, ``memory/tier.py``), and
its bytes stay in RAM after the worker that wrote them dies. ``DIST_CKPT_SHM_DIR`` moves the
base directory (tests use a private one).

One directory per job: the name holds the launcher's run id and a digest of the absolute
checkpoint root (:func:`root_digest`), so two launchers on one node with different roots (the
same run id ``0001`` each) never meet in one directory.

Ownership belongs to the node's launcher (``launch/memory_dir.py``, through
``dist_ckpt.launcher_api``): it claims the job's directory when it starts (exclusively: a live
owner is never overwritten), removes it when it stops and removes the directories of dead
launchers. It tells its workers the directory in ``DIST_CKPT_MEMORY_DIR``
(:func:`job_dir`); an empty value says the launcher owns none for them. Without the variable
(a job outside the launcher) a worker derives the same name. Workers only create the
directory when it is missing (outside the launcher nobody removes it: the memory tier
requires the launcher's run id for that reason).

Call order: any worker, and the launcher, any time.
"""

from __future__ import annotations

import hashlib
import os
import re

from ..errors import ConfigError

SHM_DIR_ENV = "DIST_CKPT_SHM_DIR"
MEMORY_DIR_ENV = "DIST_CKPT_MEMORY_DIR"
DEFAULT_BASE = "/dev/shm"
PREFIX = "dist_ckpt-"
# a directory being removed is renamed to this prefix first: never taken for a live one
REMOVING_PREFIX = ".dist_ckpt-removing-"
DIGEST_CHARS = 12
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def base_dir() -> str:
    return os.environ.get(SHM_DIR_ENV) or DEFAULT_BASE


def valid_run_id(run_id: str) -> bool:
    """A run id that names one directory (never a path)."""
    return bool(_RUN_ID.match(run_id)) and run_id not in (".", "..")


def root_digest(root: str) -> str:
    """12 hex digits of the sha256 of the absolute root (a URL as it is)."""
    absolute = root if "://" in root else os.path.abspath(root)
    return hashlib.sha256(absolute.encode()).hexdigest()[:DIGEST_CHARS]


def run_dir(run_id: str, root: str, base: str | None = None) -> str:
    """The directory of launcher run ``run_id`` checkpointing ``root`` on this node."""
    if not valid_run_id(run_id):
        raise ValueError(f"run id {run_id!r} cannot name a shared-memory directory")
    return os.path.join(base or base_dir(), f"{PREFIX}{run_id}-{root_digest(root)}")


def job_dir(run_id: str, root: str) -> str:
    """A worker: the directory its launcher owns for the job (``DIST_CKPT_MEMORY_DIR``), or
    the one :func:`run_dir` names when no launcher set the variable."""
    if MEMORY_DIR_ENV not in os.environ:
        return run_dir(run_id, root)
    directory = os.environ[MEMORY_DIR_ENV]
    if not directory:
        raise ConfigError(f"memory_tier: the launcher owns no in-memory checkpoint directory "
                          f"for this job (environment variable {MEMORY_DIR_ENV} is empty; its "
                          "log says why)")
    return directory
