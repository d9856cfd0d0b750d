"""Run directories under the launcher's ROOT: which run is active, and ``--fresh``.

The layout (``ROOT/current``, ``ROOT/runs/<id>/``, ...) is defined in ``dist_ckpt.launcher_api``.

``--fresh`` only ever adds a run directory and rewrites ``current``; it never deletes, moves or
rewrites an earlier run (a fresh run gets a fresh directory; evidence is kept).
A ROOT that already holds generations at its top level and no ``current`` (a job that used
``CheckpointConfig(root=ROOT)`` before the launcher) is continued in place as run ``root``.
"""

from __future__ import annotations

import os
import re

from dist_ckpt.launcher_api import (
    CURRENT_NAME,
    LEGACY_RUN_ID,
    RUNS_DIR,
    atomic_write,
    holds_generations,
    run_root,
)

_NUMBERED = re.compile(r"^\d{4,}$")


class RunDirError(Exception):
    """The run directory cannot be chosen as asked (exit 2)."""


def read_current(root: str) -> str | None:
    try:
        with open(os.path.join(root, CURRENT_NAME), encoding="utf-8") as handle:
            value = handle.read().strip()
    except FileNotFoundError:
        return None
    return value or None


def _next_number(root: str) -> str:
    try:
        names = os.listdir(os.path.join(root, RUNS_DIR))
    except FileNotFoundError:
        names = []
    numbers = [int(n) for n in names if _NUMBERED.match(n)]
    return f"{max(numbers, default=0) + 1:04d}"


def _continued(root: str, current: str | None) -> str | None:
    """Without ``--fresh`` or ``--run-id``: the active run, else a root that already holds
    generations at its top level (continued in place as run ``root``), else None (a new run)."""
    if current is not None:
        return current
    return LEGACY_RUN_ID if os.path.isdir(root) and holds_generations(root) else None


def existing_run(root: str, *, fresh: bool, run_id: str | None) -> str | None:
    """The directory :func:`choose_run` would continue, without creating anything; None for
    a new run. A root that is not a directory is a ``RunDirError`` here too."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise RunDirError(f"--checkpoint-root {root} is not a directory")
    if fresh:
        return None
    chosen = run_id if run_id is not None else _continued(root, read_current(root))
    return None if chosen is None else run_root(root, chosen)


def choose_run(root: str, *, fresh: bool, run_id: str | None) -> tuple[str, str, bool]:
    """``(run id, run directory, created)`` for this launch; records it in ``ROOT/current``."""
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:  # a file where the directory should be, a read-only parent, ...
        what = "is not a directory" if os.path.exists(root) else f"cannot be created ({exc.strerror})"
        raise RunDirError(f"--checkpoint-root {root} {what}") from None
    current = read_current(root)
    if run_id is not None:
        chosen = run_id
        if fresh and os.path.isdir(run_root(root, chosen)) and os.listdir(run_root(root, chosen)):
            raise RunDirError(f"--fresh --run-id {chosen}: {run_root(root, chosen)} exists already")
    elif fresh:
        chosen = _next_number(root)
    else:
        chosen = _continued(root, current) or _next_number(root)
    directory = run_root(root, chosen)
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    if chosen != current:
        atomic_write(os.path.join(root, CURRENT_NAME), f"{chosen}\n".encode())
    return chosen, directory, created
