"""Health before a start: what must hold before any worker starts, else a permanent outcome.

Call order (the launcher's main thread): :func:`preflight` before each start. Checks, in
order: the script (or program) exists; the run's root has room for one more generation (its
newest generation's size, or ``--min-free-bytes``); a configured mirror answers a LIST
within ``MIRROR_CHECK_S`` (a misnamed bucket, refused credentials or an unreachable endpoint
would otherwise surface only at the first replication, after the job ran for a while).
"""

from __future__ import annotations

import os
import shutil

from dist_ckpt import launcher_api as api

from . import records
from .options import LaunchOptions


def preflight(options: LaunchOptions, run_dir: str, mirror: str | None) -> str | None:
    """The reason no start may happen, or None. ``mirror``: ``--mirror``'s run URL, or the
    mirror the previous start's workers reported (the launcher learns it from them)."""
    return script_problem(options) or _space(options, run_dir) or (
        api.check_mirror(mirror) if mirror else None)


def script_problem(options: LaunchOptions) -> str | None:
    """Why the training script cannot run (checked before anything is created, then again
    before each start), or None."""
    args = options.torchrun
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None and not os.path.isfile(script):
            return f"program not found: {script}"
    elif not args.module and not os.path.isfile(script):
        return f"training script not found: {script}"
    return None


def _space(options: LaunchOptions, run_dir: str) -> str | None:
    need = options.min_free_bytes
    if need is None:
        need = api.newest_generation_bytes(run_dir) or 0
    try:
        free = api.free_bytes(run_dir)
    except OSError as exc:
        records.emit(f"[launch] cannot measure free space under {run_dir}: {exc}")
        return None
    if free < need:
        return (f"insufficient space: {free} bytes free under {run_dir}, a start needs "
                f"{need} (one more generation, or --min-free-bytes)")
    return None
