"""The job's one owner of retention: every pass a job runs, over the pure policy.

Each pass goes through :class:`Pruner`, which decides what may be deleted (the pins, the
generations a replay still has to copy, the rehearsal gate) and leaves the deleting to
:func:`.retention.prune`:

- the root (``prune_root``), with or without the memory tier;
- the mirror (``prune_mirror``);
- the memory tier (``prune_memory``): the newest committed in-memory generation, plus what the
  memory tier pins (``MemoryTierRunner.memory_pins``).

The rehearsal gate (``require_rehearsal``) is one check, ``_rehearsed``, made by the root and
mirror passes: nothing durable is deleted until the root's newest committed generation passed a
rehearsal (its record is in the root). The memory tier is not gated: it holds at most
``MEMORY_KEEP`` generations besides those still on their way to the root, where the gate holds.

Call order: ``submit`` (each filesystem leader, after each committed save; rank 0 also after
each mirror replay settles without the memory tier) queues ``prune_local`` on the one pruning
thread: the memory tier's replication and memory pass, or else the root pass. With the memory
tier the persistence thread calls ``prune_root`` (rank 0 after each completed persistence; on
a node-local root each other node's leader after publishing its node's copy) and
``prune_memory`` (rank 0, after each persistence settles), and rank 0's mirror thread calls
``prune_root`` after each upload settles. ``prune_mirror`` runs in rank 0's mirror thread
after each completed copy. ``settle`` waits for the passes queued so far; ``close`` (every
rank, at the manager's close) drains the thread. A failure deletes nothing and is logged:
retention must never break training.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .. import logs
from ..context import Context
from ..errors import StorageError
from ..format.inventory import inspect_generation
from ..format.manifest import MANIFEST_NAME
from ..format.validate import list_generations
from ..memory.runner import MEMORY_KEEP, MemoryTierRunner
from ..protocol.messages import PINS_KEY
from ..restore import rehearse as rehearsal
from . import retention

log = logs.get(__name__)


class Pruner:
    """One per rank. ``root_pinned`` is set once replication is open: the generations the
    mirror still has to copy out of the root are never pruned from it."""

    def __init__(self, ctx: Context, memory: MemoryTierRunner | None) -> None:
        self.ctx = ctx
        self.memory = memory
        self.root_pinned: Callable[[], set[str]] | None = None
        # with the memory tier the persistence and mirror threads both prune the root, and a
        # sweep between the persistence's check of the root's shared objects and its publish
        # could remove one it relies on: both hold this lock (the persister's publish_lock)
        self.root_lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist-ckpt-prune")
        # the files of generations a pass already took out of the root (renamed to a pending
        # name): deleted here, so that settle() need not wait for the kernel to free them
        self._discard = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist-ckpt-discard")
        self._validated: dict[tuple[str, str], str] = {}  # (generation, manifest sha256) -> state

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
        """The pruning thread's pass after a committed save."""
        if self.memory is not None:
            self.memory.replicate()  # first: the generation sent is never pruned meanwhile
            self.prune_memory()  # the root is pruned after each persistence
            return
        if self.ctx.config.keep_last:
            self.prune_root()

    def prune_root(self) -> None:
        """Root retention (``keep_last``, ``keep_every``), behind the rehearsal gate; never a
        pinned generation or one the mirror still has to upload."""
        config, root = self.ctx.config, self.ctx.tiers.root
        try:
            # behind the memory tier the persistence published each generation after checking
            # every file it copied, and on a node-local root a node's copy holds only its ranks'
            # files, which the inventory's structure check does not count as committed: there
            # the manifests that parse are the generations (committed=None)
            committed = self._root_committed() if self.memory is None else None
            if not self._rehearsed(committed):
                return
            # pins.json is on rank 0's node: other nodes' leaders read the pins in the store
            pinned = set(self.ctx.comm.read_names(PINS_KEY))
            if self.root_pinned is not None:
                pinned |= self.root_pinned()
            with self.root_lock:
                retention.prune(root, keep_last=config.keep_last, keep_every=config.keep_every,
                                pinned=frozenset(pinned), key=config.signing_key,
                                committed=committed, defer=self._discard.submit)
        except Exception:  # noqa: BLE001 - retention must never break training
            log.exception("local retention pass failed: the root %s", root.url)

    def prune_mirror(self) -> None:
        """Rank 0's mirror thread, after each completed copy into the mirror: its own
        ``mirror_keep_last``, the root's pins (the mirror's ``pins.json`` too), behind the
        rehearsal gate."""
        config, mirror = self.ctx.config, self.ctx.tiers.mirror
        assert mirror is not None
        if not self._rehearsed():
            return
        retention.prune(mirror, keep_last=config.mirror_keep_last, keep_every=config.keep_every,
                        key=config.signing_key,
                        pinned=frozenset(retention.read_pins(self.ctx.tiers.root.store)))

    def prune_memory(self) -> None:
        """The memory tier: the newest committed generation besides what it pins (ungated:
        module docstring)."""
        memory = self.memory
        assert memory is not None
        with memory.memory_prune_lock():
            try:
                retention.prune(memory.tier, keep_last=MEMORY_KEEP, pinned=memory.memory_pins(),
                                key=self.ctx.config.signing_key)
            except Exception:  # noqa: BLE001 - retention must never break training
                log.exception("memory tier retention pass failed")

    def _root_committed(self) -> list[str]:
        """The root's committed generations, newest first. Each generation's structure and
        sizes are checked once per manifest (by its sha256), not on every save's pass: a
        root of K kept generations costs K manifest reads per pass, not K times its files."""
        store, out = self.ctx.tiers.root.store, []
        seen: dict[tuple[str, str], str] = {}
        for name in list_generations(store):
            try:
                raw = store.read_bytes(f"{name}/{MANIFEST_NAME}")
            except (FileNotFoundError, StorageError):
                continue
            key = (name, hashlib.sha256(raw).hexdigest())
            state = self._validated.get(key)
            if state is None:
                state = inspect_generation(store, name, digests=False, key=self.ctx.config.signing_key).state
            seen[key] = state
            if state == "committed":
                out.append(name)
        self._validated = seen  # generations gone from the root are forgotten
        return out

    def _rehearsed(self, committed: list[str] | None = None) -> bool:
        """The rehearsal gate, for every durable tier: with ``require_rehearsal`` nothing is
        deleted until the root's newest committed generation passed a rehearsal.
        ``committed``: the root's, when the caller listed them already."""
        if not self.ctx.config.require_rehearsal:
            return True
        committed = self._root_committed() if committed is None else committed
        if not committed:
            return True
        if rehearsal.passed(self.ctx.tiers.root.store, committed[0]):
            return True
        log.info("retention waits: %s has not passed a rehearsal (require_rehearsal)", committed[0])
        return False
