"""Named fault-injection points for the fault matrix (tests and scripts only).

Configure with :func:`configure` or the ``DIST_CKPT_FAULTS`` environment variable, a JSON
object mapping a point to a spec: ``{"rank": 1, "after": 2, "delay_s": 3.0, "raise": true,
"exit": 9, "kill": true, "truncate": true}`` (every key optional; ``rank`` may be a list;
``after`` lets that many hits pass first; ``kill`` sends SIGKILL to the process; ``truncate``
is read by the caller through :func:`hit`'s return value). With nothing configured a point
costs a dict lookup. Points: ``write.before``, ``write.after``, ``report.before``,
``commit.before_manifest``, ``commit.before_rename``, ``commit.before_latest``,
``upload.file`` (before each object upload).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from .errors import DistCkptError

ENV = "DIST_CKPT_FAULTS"
_configured: dict[str, dict[str, Any]] | None = None
_hits: dict[str, int] = {}
_lock = threading.Lock()


class FaultInjected(DistCkptError):
    """Raised by an injected fault."""


def configure(spec: dict[str, dict[str, Any]] | None) -> None:
    global _configured
    _configured = dict(spec) if spec is not None else None
    with _lock:
        _hits.clear()


def _active() -> dict[str, dict[str, Any]]:
    if _configured is not None:
        return _configured
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else {}


def hit(point: str, rank: int) -> dict[str, Any]:
    """Apply the fault configured for ``point`` on ``rank``; returns the spec that fired."""
    spec = _active().get(point)
    if not spec:
        return {}
    ranks = spec.get("rank")
    if ranks is not None and rank not in (ranks if isinstance(ranks, list) else [ranks]):
        return {}
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] <= int(spec.get("after", 0)):
            return {}
    if spec.get("delay_s"):
        time.sleep(float(spec["delay_s"]))  # an injected slow rank, not synchronisation
    if spec.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.get("exit") is not None:
        os._exit(int(spec["exit"]))
    if spec.get("raise"):
        raise FaultInjected(f"fault injected at {point} on rank {rank}")
    return spec
