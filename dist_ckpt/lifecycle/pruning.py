"""Retention passes a job runs off the commit path.

Call order: ``submit`` (each filesystem leader, after each committed save; rank 0 also after
each replay settles) queues ``prune_local`` on the one pruning thread; ``prune_destination``
runs in rank 0's replay thread after each completed copy into the mirror; ``settle`` waits for
the passes queued so far; ``close`` (every rank, at the manager's close) drains the thread.
A failure deletes nothing and is logged: retention must never break training.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .. import logs
from ..context import Context
from ..format.inventory import inventory
from ..memory.runner import MemoryTierRunner
from ..ops import retention
from ..protocol.messages import PINS_KEY
from ..restore import rehearse as rehearsal

log = logs.get(__name__)


class Replays(Protocol):
    def pending(self) -> set[str]:
        """Generations a replay still has to copy out of the save target."""


class Pruner:
    """One per rank. ``replayer`` is set once replication is open: the generations it still
    has to copy are never pruned."""

    def __init__(self, ctx: Context, memory: MemoryTierRunner | None) -> None:
        self.ctx = ctx
        self.memory = memory
        self.replayer: Replays | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist-ckpt-prune")
        # the files of generations a pass already took out of the root (renamed to a pending
        # name): deleted here, so that settle() need not wait for the kernel to free them
        self._discard = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist-ckpt-discard")

    def submit(self) -> None:
        self._thread.submit(self.prune_local)

    def settle(self) -> None:
        """Return once every pass queued before this call has run (the generations it
        removed are gone from the root; their files may still be being deleted)."""
        try:
            self._thread.submit(lambda: None).result()
        except RuntimeError:  # at interpreter exit the executors take nothing new: nothing queued runs
            log.warning("retention passes not settled: the interpreter is shutting down")

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._discard.shutdown(wait=True)

    def prune_local(self) -> None:
        """Local retention; generations still waiting for their replay are kept (a corrupt
        pins.json, say, deletes nothing)."""
        if self.memory is not None:
            self.memory.replicate()  # first: the generation sent is never pruned meanwhile
            self.memory.prune_memory()  # the root is pruned after each persistence
            return
        if not self.ctx.config.keep_last:
            return
        try:
            self._prune_root()
        except Exception:  # noqa: BLE001 - retention must never break training
            log.exception("local retention pass failed")

    def _prune_root(self) -> None:
        config, root = self.ctx.config, self.ctx.tiers.root
        committed = [g.name for g in inventory(root.store, digests=False, key=config.signing_key)
                     if g.state == "committed"]
        if config.require_rehearsal and committed and not rehearsal.passed(root.store, committed[0]):
            log.info("retention waits: %s has not passed a rehearsal (require_rehearsal)", committed[0])
            return
        pinned = frozenset(self.replayer.pending()) if self.replayer is not None else frozenset()
        pinned |= self.ctx.comm.read_names(PINS_KEY)
        retention.prune(root, keep_last=config.keep_last, keep_every=config.keep_every,
                        pinned=pinned, key=config.signing_key, committed=committed,
                        defer=self._discard.submit)

    def prune_destination(self) -> None:
        """Rank 0's replay thread, after each completed copy into the mirror; pins live in the
        root."""
        config, mirror = self.ctx.config, self.ctx.tiers.mirror
        assert mirror is not None
        retention.prune(mirror, keep_last=config.mirror_keep_last, keep_every=config.keep_every,
                        key=config.signing_key,
                        pinned=frozenset(retention.read_pins(self.ctx.tiers.root.store)))
