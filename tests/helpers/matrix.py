"""What a fault-matrix test tells ``scripts/fault_matrix.py`` besides pass or fail.

A test calls ``record(row, observed=..., detect_s=..., recover_s=..., **extra)``; when the
environment names a report file (``DIST_CKPT_FAULT_REPORT``, set by the script) one JSON line
is appended to it, otherwise nothing happens. ``timed(fn)`` returns ``(result, seconds)``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

REPORT_ENV = "DIST_CKPT_FAULT_REPORT"
Result = TypeVar("Result")


def record(row: str, *, observed: str, detect_s: float | None = None, recover_s: float | None = None,
           **extra: Any) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    line = {"row": row, "observed": observed, "detect_s": detect_s, "recover_s": recover_s, **extra}
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line, default=str) + "\n")


def timed(fn: Callable[[], Result]) -> tuple[Result, float]:
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started
