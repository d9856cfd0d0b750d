"""The job's replays, chained: memory -> root (channel ``persist``, with the memory tier), then
root -> mirror (channel ``mirror``, with a mirror). One replay thread per rank and channel.

Call order: :func:`open_replayer` on every rank at the manager's construction, once the tiers
are placed (``tiers/placement.py``: the root's groups decide whether the persist channel
publishes node copies). Then, on the returned :class:`ReplayChain`:

- ``local_committed`` (every rank) and ``enqueue`` (rank 0) after each commit go to the first
  channel. Without the memory tier that is the mirror, and ``enqueue`` applies its policy
  (``mirror_every``); with it, rank 0's persist thread hands every generation it completed
  (persisted on every node's root) to the mirror channel under that policy (``_persisted``);
- ``force(G)`` (every rank, from ``finish()``): every channel copies G whatever its policy;
- ``drain`` (rank 0) waits for the channels in chain order, ``close`` (every rank) closes them
  in chain order, so the persist thread's last hand-over reaches the mirror before it stops.

Incremental generations: each channel copies a shared object only where its destination
lacks it, and publishes only once the destination holds every object the generation lists
(``replay/replayer.py``); the persist channel publishes under the root's retention lock.

Every tier's retention is the one owner's (``lifecycle/pruning.py``): the channels call it,
memory (the newest plus what the persist channel still needs), the root (``keep_last``; with
the memory tier after each persistence and each mirror upload, never a generation the mirror
still needs), the mirror (``mirror_keep_last``, after each upload).
"""

from __future__ import annotations

import threading
import time

from .. import logs
from ..context import Context
from ..memory.runner import MemoryTierRunner
from ..replay.replayer import Replayer, ReplayStats
from .pruning import Pruner

log = logs.get(__name__)


class MirrorPolicy:
    """Which generations that reached the root go to the mirror (rank 0): every ``every``-th,
    counted from the job's start, and every forced one (the final generation)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.count = 0
        self.forced: set[str] = set()
        self._lock = threading.Lock()

    def force(self, generation: str) -> None:
        with self._lock:
            self.forced.add(generation)

    def due(self, generation: str) -> bool:
        with self._lock:
            self.count += 1
            forced = generation in self.forced
            self.forced.discard(generation)
            return forced or self.count % self.every == 0


class ReplayChain:
    """The channels in chain order (``stages``: ``persist`` then ``mirror``, those configured).
    Quacks like the first channel for the save path and the pruner."""

    def __init__(self, stages: list[Replayer], policy: MirrorPolicy | None) -> None:
        self.stages = stages
        self.head = stages[0]
        self.mirror = next((s for s in stages if s.channel == "mirror"), None)
        self.policy = policy
        if self.mirror is not None and self.head is not self.mirror:
            self.head.on_completed = self._persisted

    @property
    def stats(self) -> ReplayStats:
        """The last channel's: what reached the outermost tier (the mirror, else the root)."""
        return self.stages[-1].stats

    # ---- the save path (the first channel) -----------------------------------------------
    def local_committed(self, generation: str) -> None:
        self.head.local_committed(generation)

    def enqueue(self, generation: str, manifest_raw: bytes) -> None:
        if self.head is self.mirror and self.policy is not None and not self.policy.due(generation):
            return
        self.head.enqueue(generation, manifest_raw)

    def _persisted(self, generation: str, manifest_raw: bytes) -> None:
        """Rank 0's persist thread, once ``generation`` is on every node's root."""
        assert self.mirror is not None and self.policy is not None
        if self.policy.due(generation):
            self.mirror.enqueue(generation, manifest_raw)

    def pending(self) -> set[str]:
        """What the first channel still has to copy out of the save target."""
        return self.head.pending()

    def force(self, generation: str) -> None:
        """The mirror uploads ``generation`` whatever ``mirror_every`` says (the memory tier's
        persistence is forced by ``MemoryTierRunner.force``)."""
        if self.policy is not None:
            self.policy.force(generation)

    # ---- draining ----------------------------------------------------------------------
    def drain(self, timeout_s: float) -> bool:
        """Rank 0: every channel idle, in chain order, within one ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return all(stage.drain(max(0.0, deadline - time.monotonic())) for stage in self.stages)

    def close(self, timeout_s: float) -> None:
        for stage in self.stages:
            stage.close(timeout_s)


def open_replayer(ctx: Context, memory: MemoryTierRunner | None, pruner: Pruner) -> ReplayChain | None:
    config, tiers = ctx.config, ctx.tiers
    stages: list[Replayer] = []
    if memory is not None:
        persist = memory.start_persisting(ctx.comm, pruner, ctx.root_groups)
        persist.publish_lock = pruner.root_lock  # the mirror's thread prunes the root too
        stages.append(persist)
    policy = None
    if tiers.mirror is not None:
        policy = MirrorPolicy(config.mirror_every)
        mirror = Replayer(
            ctx.comm, tiers.root, tiers.mirror, queue_length=config.mirror_queue,
            timeout_s=config.mirror_timeout_s, signing_key=config.signing_key,
            prune_destination=pruner.prune_mirror if config.mirror_keep_last else None,
            nice=config.background_nice, channel="mirror", chained=memory is not None)
        pruner.root_pinned = mirror.pending  # root retention keeps what the mirror needs
        if ctx.is_root_rank and config.keep_last:
            # with the memory tier the pruning thread prunes only memory: the root here
            mirror.on_settled = pruner.prune_root if memory is not None else pruner.submit
        stages.append(mirror)
    if not stages:
        return None
    return ReplayChain(stages, policy)

