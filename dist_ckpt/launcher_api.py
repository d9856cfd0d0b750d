"""What the launcher (``python -m launch``) may know of dist_ckpt: this module and nothing else.

``launch/`` imports only this module (``tests/test_launcher_boundary.py`` enforces it), and no
other dist_ckpt module spells the launcher's directory layout: both sides meet here. Importing
it does not import torch, so the launcher's own start stays light.

The launcher's layout under its ``--checkpoint-root`` (LAUNCHROOT)::

    LAUNCHROOT/current              the active run id (atomic replace)
    LAUNCHROOT/runs/<id>/           a run's checkpoint root (ROOT_ENV): generations, DONE.json
    LAUNCHROOT/runs/<id>/.launch/   one directory per start (LAUNCH_DIR_ENV): worker reports
    LAUNCHROOT/launch-log.jsonl     one JSON line per start of every run (read by ``dist-ckpt plan``)
    LAUNCHROOT/STOP                 the default operator stop file

A LAUNCHROOT that held generations at its top level before the launcher is continued in place
as run ``root`` (LEGACY_RUN_ID): then the run's checkpoint root is LAUNCHROOT itself.

Call order (the launcher's main thread, one launcher per node):

1. at launch: :func:`run_root` (where the chosen run lives), :func:`holds_generations` (a
   pre-launcher root), :func:`atomic_write` (``current``); the memory directory:
   :func:`memory_base_dir`, :func:`can_name_memory_dir`, :func:`memory_dir` (its name for the
   job; the workers learn it from ``MEMORY_DIR_ENV``);
2. before each start: :func:`newest_generation_bytes` and :func:`free_bytes` (the free-space
   preflight), :func:`check_mirror` (a configured mirror answers); the environment of the
   workers: ``ROOT_ENV``, ``RUN_ID_ENV``, ``LAUNCH_DIR_ENV``, ``MIRROR_ENV`` (:func:`mirror_run_url`);
3. during each start, every poll: :func:`read_marks` (each rank's :class:`Mark`: its last
   update, when, and whether it is inside a save, restore or finish), for the watchdog; on a
   preemption: the notice file ``PREEMPT_NOTICE_NAME`` in the start's directory (the workers
   save, then exit with ``PREEMPTED_EXIT``);
4. after each start: :func:`read_reports` (what each rank wrote through ``dist_ckpt.runinfo``),
   :func:`find_done` (did the run finish), :func:`latest_update` and :func:`latest_generation`
   (how far it got);
5. when it is about to exit, before removing the memory directory: :func:`persist_memory`
   (a committed in-memory generation newer than the root's goes to the root first).

``dist-ckpt plan`` and ``dist-ckpt runs`` call :func:`launch_log_dirs` to find the launcher's log
for a checkpoint root; ``RUNS_COMMAND`` is the latter's name (spelled here: it is the layout's
word for runs).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from .config import ROOT_ENV
from .errors import PREEMPTED_EXIT, DistCkptError
from .format.manifest import parse_generation, read_latest_name
from .format.validate import read_manifest
from .lifecycle.done import DoneRecord, check_done
from .marks import Mark, read_marks
from .memory.breakpoint import Persisted
from .memory.breakpoint import persist_memory as _persist_memory
from .memory.paths import MEMORY_DIR_ENV, SHM_DIR_ENV, root_digest
from .memory.paths import PREFIX as MEMORY_DIR_PREFIX
from .memory.paths import REMOVING_PREFIX as MEMORY_REMOVING_PREFIX
from .memory.paths import base_dir as memory_base_dir
from .memory.paths import run_dir as memory_dir
from .memory.paths import valid_run_id as can_name_memory_dir
from .runinfo import (
    LAUNCH_DIR_ENV,
    MIRROR_ENV,
    PREEMPT_NOTICE_NAME,
    RUN_ID_ENV,
    WorkerReport,
    read_report,
    read_reports,
)
from .storage.base import open_store, parent_url
from .storage.local import atomic_write, free_bytes

__all__ = [
    "CURRENT_NAME", "LAUNCH_DIR_ENV", "LAUNCH_LOG_NAME", "LEGACY_RUN_ID", "MEMORY_DIR_ENV",
    "MEMORY_DIR_PREFIX", "MEMORY_REMOVING_PREFIX", "MIRROR_ENV", "PREEMPTED_EXIT",
    "PREEMPT_NOTICE_NAME", "ROOT_ENV", "RUNS_COMMAND", "RUNS_DIR", "RUN_ID_ENV", "SHM_DIR_ENV",
    "STARTS_DIR", "STOP_NAME",
    "DoneRecord", "Mark", "Persisted", "WorkerReport", "atomic_write", "can_name_memory_dir",
    "check_mirror", "find_done", "free_bytes", "holds_generations", "latest_generation",
    "latest_update", "launch_log_dirs", "memory_base_dir", "memory_dir", "mirror_run_url",
    "newest_generation_bytes", "persist_memory", "read_marks", "read_report", "read_reports",
    "run_root",
]

# ---- the layout -------------------------------------------------------------------------
CURRENT_NAME = "current"
RUNS_DIR = "runs"
STARTS_DIR = ".launch"
LAUNCH_LOG_NAME = "launch-log.jsonl"
STOP_NAME = "STOP"
LEGACY_RUN_ID = "root"
RUNS_COMMAND = "runs"  # dist-ckpt runs ROOT: the runs and starts of LAUNCHROOT/launch-log.jsonl


def run_root(launch_root: str, run_id: str) -> str:
    """The checkpoint root of run ``run_id`` under the launcher's root."""
    return launch_root if run_id == LEGACY_RUN_ID else os.path.join(launch_root, RUNS_DIR, run_id)


def mirror_run_url(mirror: str, run_id: str) -> str:
    """Where run ``run_id`` replicates under the ``--mirror`` URL (same layout as the disk)."""
    return f"{mirror}/{RUNS_DIR}/{run_id}"


def launch_log_dirs(checkpoint_root: str) -> list[str]:
    """Where the launcher's log of the run at ``checkpoint_root`` may be, in the order to try:
    the root itself (a run continued in place), then the LAUNCHROOT of LAUNCHROOT/runs/<id>."""
    here, launch_root = parent_url(checkpoint_root, 0), parent_url(checkpoint_root, 2)
    return [d for d in (here, launch_root) if d is not None]


def holds_generations(directory: str) -> bool:
    """Whether ``directory`` has generations at its top level (a checkpoint root in use)."""
    return any(parse_generation(name) is not None for name in os.listdir(directory))


# ---- the run's progress -------------------------------------------------------------------
def latest_update(run_root: str) -> int | None:
    """The update the run's latest pointer names; None without a readable pointer. A hint
    for the launcher's record, never trusted over validation."""
    name = read_latest_name(open_store(run_root))
    return None if name is None else parse_generation(name)


def latest_generation(run_root: str) -> str | None:
    """The generation the run's latest pointer names; None without a readable pointer."""
    return read_latest_name(open_store(run_root))


def newest_generation_bytes(run_root: str) -> int | None:
    """Bytes of the generation the latest pointer names (the size of one more save); None
    when there is no readable pointer or manifest (no estimate: the start is not held up)."""
    store = open_store(run_root)
    name = read_latest_name(store)  # a checked name, never a path
    if name is None:
        return None
    try:
        return read_manifest(store, name).total_bytes
    except (OSError, ValueError, DistCkptError):
        return None


def find_done(roots: Iterable[str], *, contract_digest: str | None,
              mirror: str | None) -> DoneRecord | None:
    """The first DONE record among ``roots`` (in order) that holds for the run with
    ``contract_digest`` (None: whatever contract it records): its final generation validates
    there, or in ``mirror`` for a node-local root. None when no root has one."""
    mirror_store = open_store(mirror) if mirror else None
    for root in roots:
        record, _ = check_done(open_store(root), contract_digest=contract_digest, mirror=mirror_store)
        if record is not None:
            return record
    return None


# ---- the launcher's exit ------------------------------------------------------------------
def persist_memory(memory_dir: str, run_root: str, *, nodes: int = 1) -> Persisted | None:
    """Before the launcher removes ``memory_dir``: its committed generation of ``run_root``
    newer than the root's newest, persisted there (verified copy, the usual publish); None when
    memory holds nothing newer. ``nodes``: the job's node count (above 1, this node brings
    its part). Only the memory of ``run_root`` (the root the launcher exports) is looked at."""
    return _persist_memory(os.path.join(memory_dir, root_digest(run_root)), run_root, nodes=nodes)


# ---- health before a start ----------------------------------------------------------------
MIRROR_CHECK_S = 20.0


def check_mirror(url: str, timeout_s: float = MIRROR_CHECK_S) -> str | None:
    """Whether the object store at ``url`` answers a LIST of it within ``timeout_s``: None
    when it does (an empty or absent prefix in an existing bucket is fine: a new run), else
    the reason (no such bucket, refused credentials, unreachable endpoint, no answer). The
    LIST runs in a daemon thread: a client that retries an unreachable endpoint for minutes
    is abandoned at the deadline, not waited for."""
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            open_store(url).listdir("")
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is the finding
            outcome.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")

    thread = threading.Thread(target=probe, daemon=True, name="dist-ckpt-mirror-check")
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        return f"mirror {url} did not answer a LIST within {timeout_s:g} s"
    return None if outcome[0] is None else f"mirror {url} does not answer: {outcome[0]}"
