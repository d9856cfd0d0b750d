"""What happens to each generation after its save ended: one pipeline, one place.

Call order: the save path hands every finished ``SaveJob`` to :meth:`AfterCommit.finished`
(every rank, from the save thread of an asynchronous save, else the main thread), which
releases the job's staging slot and, for a committed generation, runs in this order:

1. the commit log line and the launcher's report of the newest committed update (rank 0);
2. ``local_committed`` on the replayer (every rank: its replay of this generation may start);
3. the replay's queue (rank 0; with the memory tier only the generations the persist policy
   picks, the final one always);
4. a pruning pass queued on the pruning thread (filesystem leaders, when retention is on).

Nothing here blocks on storage: the replay and the pruning run on their own threads, so
``wait()`` and the in-flight bound do not include them.
"""

from __future__ import annotations

import logging

from .. import logs, runinfo
from ..context import Context
from ..format.manifest import Manifest
from ..memory.runner import MemoryTierRunner
from ..save.request import SaveJob
from ..save.staging import StagingPool, StagingSlot
from .pruning import Pruner
from .replication import ReplayChain

log = logs.get("dist_ckpt.manager")


class AfterCommit:
    def __init__(self, ctx: Context, staging: StagingPool | None, memory: MemoryTierRunner | None,
                 replayer: ReplayChain | None, pruner: Pruner) -> None:
        self.ctx = ctx
        self.staging = staging
        self.memory = memory
        self.replayer = replayer
        self.pruner = pruner

    def finished(self, slot: StagingSlot | None, job: SaveJob) -> None:
        if slot is not None and self.staging is not None:
            self.staging.release(slot)
        if job.committed:
            self.committed(job)

    def committed(self, job: SaveJob) -> None:
        ctx, name = self.ctx, job.request.generation
        if ctx.is_root_rank:
            log_commit(job, ctx.tiers.target.url if self.memory else ctx.config.root,
                       asynchronous=ctx.config.async_save)
            # the launcher's start line counts this generation even if only memory holds it
            runinfo.report(0, committed_update=job.request.next_update)
        if self.replayer is not None:
            self.replayer.local_committed(name)
            if ctx.is_root_rank and job.manifest_raw is not None \
                    and (self.memory is None or self.memory.persists(name)):
                self.replayer.enqueue(name, job.manifest_raw)
        if ctx.is_fs_leader and (ctx.config.keep_last or self.memory):
            self.pruner.submit()


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
