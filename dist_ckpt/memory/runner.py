"""The memory tier in front of the persistent root (``CheckpointConfig(memory_tier=True)``).

Saves commit to the memory tier (``memory/tier.py``) with the usual protocol (agreement,
write, every rank's report, rank 0's manifest-last commit under ``commit_timeout_s``; node
copies by each filesystem leader). The persistent root is fed from memory by a replay
(``save/replay.py``: one replay thread per rank, every rank's report, rank 0's
manifest-last publish under ``mirror_timeout_s``), for every ``persist_every``-th committed
in-memory generation and for the final one of ``finish()``. Each replayed file is hashed as
it is copied: bytes changed in memory never become a persistent generation.

Call order:
- ``persists(G)``: rank 0, once per committed in-memory generation (the save's ``on_done``);
  True means "enqueue G for persistence" (``PersistPolicy``: every ``persist_every``-th,
  and/or once ``persist_interval_s`` passed since the last one chosen);
- ``force(G)``: rank 0, from ``finish()``: G is persisted whatever the count;
- ``prune_memory``: each filesystem leader's pruning thread after each in-memory commit, and
  rank 0's after each persistence settles: keep the newest committed in-memory generation,
  plus those being persisted (the one being written is a pending directory, never pruned);
- ``prune_root``: rank 0's replay thread after each completed persistence (``keep_last``), and
  on a node-local root each other node's leader after publishing its node's copy; never a
  generation ``root_pinned`` names (the mirror's still to upload);
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
from typing import TYPE_CHECKING

from .. import logs, runinfo
from ..config import CheckpointConfig
from ..ops import retention
from ..protocol.comm import Comm
from ..protocol.messages import PINS_KEY
from ..save.replay import Replayer
from ..tiers.base import CommitTier
from ..tiers.placement import RootGroups
from .ring import NodeRing
from .tier import MemoryTier, open_memory_tier

if TYPE_CHECKING:
    from ..restore.loader import RestoreResult

log = logs.get(__name__)
MEMORY_KEEP = 1  # committed in-memory generations kept besides those still being persisted


class PersistPolicy:
    """Which committed in-memory generations go to the root (rank 0 decides; the mirror
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
        self.root_lock = threading.Lock()  # the persist and mirror threads both prune the root
        self.root_pinned: Callable[[], set[str]] | None = None  # the mirror's still to upload
        self.ring: NodeRing | None = None

    def start_persisting(self, comm: Comm, groups: RootGroups | None = None) -> Replayer:
        """Every rank, once the filesystem groups are known: the replay thread to the root
        (``groups``: with a node-local root, each node's leader publishes its node's copy)."""
        self.persister = Replayer(
            comm, self.tier, self.root, queue_length=self.config.mirror_queue,
            timeout_s=self.config.mirror_timeout_s, signing_key=self.config.signing_key,
            prune_destination=self.prune_root if self.config.keep_last else None,
            nice=self.config.background_nice, channel="persist", groups=groups)
        if self.config.keep_last:
            self.persister.on_copied = self.prune_root
        if comm.rank == 0:
            self.persister.on_settled = self.prune_memory
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

    def prune_memory(self) -> None:
        """Janitor thread (leaders) and rank 0's persistence thread: never while this node's
        generation is being sent to its ring successor (the ring's lock)."""
        pinned = frozenset(self.persister.pending()) if self.persister is not None else frozenset()
        with self.ring.push_lock if self.ring is not None else contextlib.nullcontext():
            try:
                if self.ring is not None:  # a lost node's peers keep what rebuilds it
                    pinned |= self.ring.protected()
                retention.prune(self.tier, keep_last=MEMORY_KEEP, pinned=pinned | self._forced,
                                key=self.config.signing_key)
            except Exception:  # noqa: BLE001 - retention must never break training
                log.exception("memory tier retention pass failed")

    def prune_root(self) -> None:
        pinned = set(retention.read_pins(self.root.store))
        if self.persister is not None:  # pins.json is on rank 0's node: the store has them
            pinned |= self.persister.comm.read_names(PINS_KEY)
        if self.root_pinned is not None:
            pinned |= self.root_pinned()
        with self.root_lock:
            retention.prune(self.root, keep_last=self.config.keep_last,
                            keep_every=self.config.keep_every, key=self.config.signing_key,
                            pinned=frozenset(pinned))

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
