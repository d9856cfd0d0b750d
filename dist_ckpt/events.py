"""The lines the library logs when things go right: one per commit, one per restore."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import logs
from .format.manifest import Manifest

if TYPE_CHECKING:  # annotations only: this module sits below the save and restore layers
    from .restore.loader import RestoreResult
    from .save.request import SaveJob

log = logs.get("dist_ckpt.manager")


def log_commit(job: SaveJob, root: str, *, asynchronous: bool) -> None:
    """Rank 0, after a generation committed: what it cost and where it went."""
    if not log.isEnabledFor(logging.INFO):  # parsing a large manifest costs; skip when unheard
        return
    name = job.request.generation
    try:
        total = Manifest.from_bytes(job.manifest_raw or b"", generation=name).total_bytes
    except Exception:  # noqa: BLE001 - a log line must not fail a committed save
        total = 0
    rate = total / job.duration_s / (1 << 20) if job.duration_s > 0 else 0.0
    blocking = f"blocking {job.blocking_s:.3f} s" if asynchronous else "synchronous"
    log.info("committed %s: %.1f MiB, %s, durable after %.3f s (%.0f MiB/s) in %s",
             name, total / (1 << 20), blocking, job.duration_s, rate, root)


def log_restore(result: RestoreResult, tier: str | None) -> None:
    for problem in result.rejected:
        log.warning("rejected generation %s", problem)
    for warning in result.warnings:
        log.warning("%s", warning)
    if result.generation is None:
        log.info("restore: no generation validates; fresh start (%d rejected)", len(result.rejected))
    else:
        log.info("restored %s (next_update %d) from %s; %d rejected", result.generation,
                 result.next_update, tier, len(result.rejected))
