"""Named fault-injection points for the fault matrix (tests and scripts only).

Configure with :func:`configure` or the ``DIST_CKPT_FAULTS`` environment variable, a JSON
object mapping a point to a spec: ``{"rank": 1, "delay_s": 3.0, "raise": true, "exit": 9}``
(every key optional; ``rank`` may be a list). With nothing configured a point costs a dict
lookup. Points: ``write.before``, ``write.after``, ``report.before``,
``commit.before_manifest``, ``commit.before_rename``, ``commit.before_latest``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .errors import DistCkptError

ENV = "DIST_CKPT_FAULTS"
_configured: dict[str, dict[str, Any]] | None = None


class FaultInjected(DistCkptError):
    """Raised by an injected fault."""


def configure(spec: dict[str, dict[str, Any]] | None) -> None:
    global _configured
    _configured = dict(spec) if spec is not None else None


def _active() -> dict[str, dict[str, Any]]:
    if _configured is not None:
        return _configured
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else {}


def hit(point: str, rank: int) -> None:
    spec = _active().get(point)
    if not spec:
        return
    ranks = spec.get("rank")
    if ranks is not None and rank not in (ranks if isinstance(ranks, list) else [ranks]):
        return
    if spec.get("delay_s"):
        time.sleep(float(spec["delay_s"]))  # an injected slow rank, not synchronisation
    if spec.get("exit") is not None:
        os._exit(int(spec["exit"]))
    if spec.get("raise"):
        raise FaultInjected(f"fault injected at {point} on rank {rank}")
