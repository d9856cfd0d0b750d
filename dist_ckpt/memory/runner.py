"""The memory tier in front of the persistent root (``CheckpointConfig(memory_tier=True)``).

Saves commit to the memory tier (``memory/tier.py``) with the usual protocol (agreement,
write, every rank's report, rank 0's manifest-last commit under ``commit_timeout_s``; node
copies by each filesystem leader). The persistent root is fed from memory by a replay
(``replay/replayer.py``: one replay thread per rank, every rank's report, rank 0's
manifest-last publish under ``persist_timeout_s``), for every ``persist_every``-th committed
in-memory generation and for the final one of ``finish()``. Each replayed file is hashed as
it is copied: bytes changed in memory never become a persistent generation.

Call order:
- ``persists(G)``: rank 0, once per committed in-memory generation (the save's ``on_done``);
  True means "enqueue G for persistence" (``PersistPolicy``: every ``persist_every``-th,
  and/or once ``persist_interval_s`` passed since the last one chosen);
- ``force(G)``: rank 0, from ``finish()``: G is persisted whatever the count;
- retention is not decided here: the job's one owner (``lifecycle/pruning.py``, the
  ``Retention`` given to ``start_persisting``) prunes memory and root. This runner gives it
  what only the memory tier knows: ``memory_pins`` (generations still being persisted, those
  a lost peer rebuilds from, those forced) under ``memory_prune_lock``, and calls its
  ``prune_root`` from the persistence thread (rank 0 after each completed persistence; on a
  node-local root each other node's leader after publishing its node's copy) and its
  ``prune_memory`` after each persistence settles (rank 0);
- ``before_restore``: every rank at the start of ``restore()`` (collective; ``memory/ring.py``);
- ``after_restore``: every rank after ``restore()``; the filesystem leaders drop in-memory
  generations newer than the one resumed from (rejected, or saved by another world size).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .. import logs, runinfo
from ..config import CheckpointConfig
from ..protocol.comm import Comm
from ..replay.replayer import Replayer
from ..tiers.base import CommitTier
from ..tiers.placement import RootGroups
from .ring import NodeRing
from .tier import MemoryTier, open_memory_tier

if TYPE_CHECKING:
    from ..restore.loader import RestoreResult

log = logs.get(__name__)
MEMORY_KEEP = 1  # committed in-memory generations kept besides those still being persisted


class PersistPolicy:
    """Which committed in-memory generations go to the root (rank 0 decides; the replay's
    announcement tells the other ranks). Counting applies unless only an interval was set."""

    def __init__(self, config: CheckpointConfig, clock: Callable[[], float] = time.monotonic) -> None:
        interval_only = config.persist_interval_s is not None \
            and "persist_every" not in config.model_fields_set
        self.every = None if interval_only else config.persist_every
        self.interval_s = config.persist_interval_s
        self.clock = clock
        self.committed = 0
        self.last_chosen = clock()  # the job's start

    def due(self) -> bool:
        """One more generation committed in memory: persist it?"""
        self.committed += 1
        now = self.clock()
        by_count = self.every is not None and self.committed % self.every == 0
        by_time = self.interval_s is not None and now - self.last_chosen >= self.interval_s
        if by_count or by_time:
            self.last_chosen = now
        return by_count or by_time


class Retention(Protocol):
    """The job's retention owner, as the persistence thread calls it."""

    def prune_root(self) -> None: ...

    def prune_memory(self) -> None: ...


class MemoryTierRunner:
    """One per rank. ``tier`` is the save target; ``root`` the persistent tier behind it."""

    def __init__(self, config: CheckpointConfig, root: CommitTier) -> None:
        self.config = config
        self.root = root
        self.tier: MemoryTier = open_memory_tier(config.root, os.environ.get(runinfo.RUN_ID_ENV))
        self.persister: Replayer | None = None
        self.policy = PersistPolicy(config)
        self._forced: set[str] = set()
        self._lock = threading.Lock()
        self.ring: NodeRing | None = None

    def start_persisting(self, comm: Comm, retention: Retention,
                         groups: RootGroups | None = None) -> Replayer:
        """Every rank, once the filesystem groups are known: the replay thread to the root
        (``groups``: with a node-local root, each node's leader publishes its node's copy),
        which calls ``retention`` after each persistence."""
        self.persister = Replayer(
            comm, self.tier, self.root, queue_length=self.config.persist_queue,
            timeout_s=self.config.persist_timeout_s, signing_key=self.config.signing_key,
            prune_destination=retention.prune_root if self.config.keep_last else None,
            nice=self.config.background_nice, channel="persist", groups=groups)
        if self.config.keep_last:
            self.persister.on_copied = retention.prune_root
        if comm.rank == 0:
            self.persister.on_settled = retention.prune_memory
        self.ring = NodeRing(comm, self.tier, replicate=self.config.memory_replica,
                             backend=self.config.peer_backend)
        self.tier.peers = self.ring
        return self.persister

    def persists(self, generation: str) -> bool:
        with self._lock:
            forced = generation in self._forced
            self._forced.discard(generation)
            return self.policy.due() or forced

    def force(self, generation: str) -> None:
        with self._lock:
            self._forced.add(generation)

    def memory_prune_lock(self) -> contextlib.AbstractContextManager:
        """Held while memory is pruned: never while this node's generation is being sent to
        its ring successor (the ring's lock)."""
        return self.ring.push_lock if self.ring is not None else contextlib.nullcontext()

    def memory_pins(self) -> frozenset[str]:
        """In-memory generations no retention pass may remove: those still being persisted,
        those a lost node's peers rebuild it from, those forced to the root. Under
        ``memory_prune_lock``."""
        pinned = frozenset(self.persister.pending()) if self.persister is not None else frozenset()
        if self.ring is not None:
            pinned |= self.ring.protected()
        return pinned | frozenset(self._forced)

    def replicate(self) -> None:
        """Filesystem leaders, pruning thread, before ``prune_memory``: the ring copies."""
        if self.ring is None:
            return
        try:
            self.ring.push_newest()
            self.ring.settle_replicas()
        except Exception:  # noqa: BLE001 - replicas must never break training
            log.exception("memory tier replication pass failed")

    def close(self, after_error: bool = False) -> None:
        if self.ring is not None:
            self.ring.close(after_error)

    def before_restore(self) -> None:
        """Every rank (collective), before selection: each node's memory copy completed from
        its peers (more than one node)."""
        if self.ring is not None:
            self.ring.repair()

    def after_restore(self, comm: Comm, result: RestoreResult) -> None:
        if self.ring is not None:
            self.ring.after_restore()
        if comm.rank != comm.fs_leader:
            return
        if self.ring is not None:
            self.ring.drop_newer_replicas(result.generation)
        dropped = self.tier.drop_newer(result.generation)
        if dropped:
            log.warning("dropped in-memory generation(s) %s, newer than the resumed %s",
                        ", ".join(sorted(dropped)), result.generation or "fresh start")
