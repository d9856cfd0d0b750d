"""Replay: every rank copies its files of a committed generation from a source tier into a
destination tier, and rank 0 publishes it there. Each replay has a channel
(``replay/channels.py``), which scopes its store keys, fault points, settings and record:
``persist`` (the memory tier into the root, ``memory/runner.py``) and ``mirror`` (the root
into ``config.mirror``). With both, they run chained (``lifecycle/replication.py``): a
generation the persist channel completed is enqueued to the mirror channel.

Protocol (one replay thread per rank and channel; coordination only through the c10d store):
1. ``enqueue`` (rank 0, after a local commit or the previous channel's completion): the
   generation joins a bounded queue; when the queue is full the oldest waiting generation is
   skipped (policy: keep the newest) and recorded as skipped in the channel's record
   (``replay/record.py``).
2. rank 0's replay thread announces the next generation to copy (a ``ReplayAnnouncement``:
   the name and the manifest's sha256, under ``replay_seq_key(channel, n)``) and rings the
   job's bell (``protocol/node.py``); every other rank's replay thread, idle, reads only its
   node's bell and checks the store once per ring. Each (all ranks, in sequence order) waits
   until its own copy is in place (``local_committed``; not for a chained channel, whose
   source rank 0 completed before announcing), reads the manifest from its source tier and
   checks its digest, replays its own files of that committed generation into the
   destination (``CommitTier.begin`` with ``source_dir``, then ``put_files``: hashed as
   copied, or uploaded and verified) and reports a ``ReplayReport`` through its node leader
   (``protocol/gather.py``, scope ``replay_scope(channel, n)``). Fault point
   ``<channel>.upload``.
   A shared object of an incremental generation (``objects/<name>``, in the source's
   ``objects/``) is copied or uploaded by the rank that wrote it, to the destination's own
   ``objects/`` (through the pending directory of a rename tier), and only when the destination
   lacks it: each object crosses once, whatever number of generations reference it.
3. rank 0, once every rank reported within the channel's timeout (fault point
   ``<channel>.before_publish``), checks that the destination holds every shared object the
   manifest lists (a missing one fails the replay: a generation is never published, nor
   recorded as completed, before every byte it references is there), then publishes the
   attempt (the manifest last).
   Check and publish run under ``publish_lock`` where one is set: the persist channel shares
   the root's retention lock, so a root prune never sweeps between them an object the check
   found. With node copies (a node-local root: ``RootGroups`` with more than one group),
   rank 0 then offers the common files' bytes
   (``common_files.offer``) and posts the outcome under ``replay_outcome_key``; the leader of
   every other group puts the common files, verified, into its node's copy
   (``common_files.install``), publishes that copy (its ranks' files, the common files and
   the manifest; fault point ``<channel>.node_copy``) and reports under ``replay_copy_key``;
   rank 0 waits for every leader's report within the same deadline, then withdraws the offer.
4. rank 0 records the generation as the last completed one in the channel's record under
   the source and calls ``on_completed`` (the chain's next channel). An enqueued, half-copied or
   partly published generation is never recorded as completed. Rank 0 then deletes that
   sequence's store keys.

Source retention: rank 0 keeps the set of generations it still has to copy (queued and
active) in the store key ``replay_pinned_key(channel)``; every rank's ``pending()`` reads it,
so the leader of a node without rank 0 never prunes a generation a replay still needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch.distributed as dist

from .. import faults, logs
from ..errors import DistCkptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.objects import holds_object
from ..protocol import gather, messages
from ..protocol.comm import Comm
from ..protocol.messages import Collected, ReplayAnnouncement, ReplayReport
from ..save.priority import lower_thread_priority
from ..storage.base import open_store
from ..tiers.base import CommitTier
from ..tiers.placement import RootGroups
from . import common_files
from .channels import channel as channel_spec
from .record import update_record

log = logs.get(__name__)
# a follower asks the store only after the node's bell changed, and otherwise this seldom: a
# guard against a ring it could not see (its node's watcher gone), not the way it learns.
# After a local commit, when rank 0's announcement is near, it hints the node's watcher,
# which then reads the bell fast for a while: one reader per node, never one per rank
IDLE_CHECK_S = 60.0
BELL_WAIT_S = 5.0  # how long one look at the bell waits before the follower looks at its clock


@dataclass
class ReplayStats:
    enqueued: int = 0
    skipped: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    max_queue: int = 0
    max_uploading: int = 0


class Replayer:
    """One per rank; ``enqueue`` is called on rank 0 only, ``close`` on every rank."""

    def __init__(self, comm: Comm, source: CommitTier, destination: CommitTier, *, queue_length: int,
                 timeout_s: float, signing_key: bytes | None = None,
                 prune_destination: Callable[[], object] | None = None, nice: int = 10,
                 channel: str, chained: bool = False,
                 groups: RootGroups | None = None) -> None:
        self.channel = channel
        self.timeout_name = channel_spec(channel).timeout  # named in the failures it explains
        # chained: the source holds each announced generation complete already (rank 0
        # announces only what the previous channel completed), so no rank waits for its copy
        self.chained = chained
        # node copies: the destination has one copy per group of ``groups`` (node-local root)
        self.groups = groups if groups is not None and not groups.shared and not destination.shared else None
        self.on_completed: Callable[[str, bytes], None] | None = None  # rank 0: the chain's next
        self.on_copied: Callable[[], None] | None = None  # a copying leader, after its node copy
        self.nice = nice  # the replay thread's priority drop (config background_nice)
        self.prune_destination = prune_destination  # rank 0, after each completed replay
        self.signing_key = signing_key
        self.on_settled: Callable[[], None] | None = None  # rank 0: after each replay settles
        # rank 0: held around the objects' check and the publish; the lock of the destination's
        # retention when another thread prunes it (lifecycle/replication.py)
        self.publish_lock: AbstractContextManager[object] = contextlib.nullcontext()
        self.comm = comm
        self.source = source
        self.local_root = source.local_root
        self.destination = destination
        self.queue_length = queue_length
        self.timeout_s = timeout_s
        self.stats = ReplayStats()
        self._queue: deque[tuple[str, bytes]] = deque()
        self._cond = threading.Condition()
        self._uploading = 0
        self._active: str | None = None
        self._local_done: set[str] = set()
        # set by close; an event (not a flag under _cond) so a follower's bell wait ends on it
        self._closing = threading.Event()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dist-ckpt-{channel}")
        self._thread.start()

    # ---- rank 0 ------------------------------------------------------------------------
    def enqueue(self, generation: str, manifest_raw: bytes) -> None:
        with self._cond:
            self._queue.append((generation, manifest_raw))
            self.stats.enqueued += 1
            while len(self._queue) > self.queue_length:
                skipped, _ = self._queue.popleft()
                self.stats.skipped.append(skipped)
                log.warning("%s behind: skipping %s (keeping the newest)", self.channel, skipped)
                self._record(skipped=skipped)
            self.stats.max_queue = max(self.stats.max_queue, len(self._queue))
            self._publish_pinned()
            self._cond.notify_all()

    def _publish_pinned(self) -> None:
        # caller holds self._cond; generations still to copy, for followers' retention
        names = {g for g, _ in self._queue} | ({self._active} if self._active else set())
        try:
            self.comm.publish_names(messages.replay_pinned_key(self.channel), names)
        except Exception:  # noqa: BLE001 - followers keep their last view; replays go on
            log.exception("could not publish the %s replay's pinned generations", self.channel)

    # ---- all ranks ---------------------------------------------------------------------
    def local_committed(self, generation: str) -> None:
        """This rank's copy of ``generation`` is in place (its save job finished)."""
        self.comm.node.hint()
        with self._cond:
            self._local_done.add(generation)
            self._cond.notify_all()

    def _wait_local(self, generation: str) -> bool:
        # on node-local disks a node's copy is renamed into place after rank 0 announced it
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while generation not in self._local_done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
            self._local_done.discard(generation)
        return True

    def pending(self) -> set[str]:
        """Generations queued or being copied (by any rank): local retention keeps them."""
        with self._cond:
            mine = {g for g, _ in self._queue} | ({self._active} if self._active else set())
        if self.comm.rank == 0:
            return mine
        return mine | self.comm.read_names(messages.replay_pinned_key(self.channel))

    def _next(self) -> tuple[str, bytes] | None:
        with self._cond:
            while not self._queue and not self._closing.is_set():
                self._cond.wait()
            if not self._queue:
                return None
            item = self._queue.popleft()
            self._active = item[0]
            self._publish_pinned()
            return item

    # ---- all ranks ---------------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority(self.nice)
        # the node's followers wait on the bell its leader's watcher keeps; the leader itself
        # may never wait on it (rank 0 announces), so every rank's replayer asks for the watcher
        self.comm.node.watch()
        while True:
            self._seq += 1
            seq_key = messages.replay_seq_key(self.channel, self._seq)
            manifest_raw: bytes | None = None
            if self.comm.rank == 0:
                item = self._next()
                announce = ReplayAnnouncement.stop_message() if item is None else \
                    ReplayAnnouncement(item[0], hashlib.sha256(item[1]).hexdigest())
                messages.post(self.comm, seq_key, announce)
                self.comm.node.ring()
                manifest_raw = item[1] if item is not None else None
            else:  # follow rank 0's sequence until it announces the stop
                try:
                    announce = self._await_announcement(seq_key)
                except dist.DistError as exc:  # the job's store ended with rank 0's side
                    log.warning("%s: the store is gone, no further %s on this rank (%s)",
                                self.channel, self.channel, exc)
                    return
            if announce.stop:
                return
            with self._cond:
                self._active = announce.generation
            try:
                self._replicate(announce, manifest_raw)
            finally:
                with self._cond:
                    self._active = None
                    if self.comm.rank == 0:
                        self._publish_pinned()
                    self._cond.notify_all()

    def _await_announcement(self, seq_key: str) -> ReplayAnnouncement:
        """A follower: the next announcement. Idle, it reads only the node's bell (a file the
        node's one watcher keeps, ``protocol/node.py``) and asks the store once per ring (and
        once per ``IDLE_CHECK_S`` without one)."""
        bell = self.comm.node.bell
        seen, changed, checked = bell.value(), True, float("-inf")
        while True:
            # this rank closing: rank 0's stop is near, and the watcher that would show its
            # ring may have closed with its node's leader (once per close, not per save)
            if self._closing.is_set():
                if not self.comm.store_wait([seq_key], 0.5):
                    break
                continue
            # rank 0 rings after each announcement: a bell that did not change since the last
            # look at the store means nothing new to read there
            if changed or time.monotonic() - checked >= IDLE_CHECK_S:
                if self.comm.store.check([seq_key]):
                    break
                checked = time.monotonic()
            value = bell.wait(seen, BELL_WAIT_S, stop=self._closing)
            changed, seen = value != seen, value
        return messages.decode(ReplayAnnouncement, self.comm.store_get(seq_key))

    def _manifest(self, announce: ReplayAnnouncement) -> bytes:
        """A follower: the announced generation's manifest, read from this rank's source tier
        (its copy is in place: ``_wait_local``) and checked against the announced digest."""
        manifest_raw = self.source.store.read_bytes(f"{announce.generation}/{MANIFEST_NAME}")
        if hashlib.sha256(manifest_raw).hexdigest() != announce.manifest_sha256:
            raise DistCkptError(f"the source's manifest of {announce.generation} is not the one "
                                "rank 0 announced")
        return manifest_raw

    def _replicate(self, announce: ReplayAnnouncement, manifest_raw: bytes | None) -> None:
        generation = announce.generation
        attempt = self.destination.begin(generation, f"{self.comm.session}-{self._seq}",
                                    source_dir=os.path.join(self.local_root, generation))
        with self._cond:
            self._uploading += 1
            self.stats.max_uploading = max(self.stats.max_uploading, self._uploading)
        # rank 0 holds the manifest it enqueued; the others read theirs once their copy is in place
        manifest = Manifest.model_validate_json(manifest_raw) if manifest_raw is not None else None
        try:
            if not self.chained and not self._wait_local(generation):
                raise DistCkptError(f"{generation} never completed locally on this rank")
            if manifest is None:
                manifest_raw = self._manifest(announce)
                manifest = Manifest.model_validate_json(manifest_raw)
            faults.hit(f"{self.channel}.upload", self.comm.rank)
            # the writer's form: an entry carries only its own algorithm's digest
            attempt.put_files([f.model_dump(exclude_none=True) for f in manifest.files
                               if f.rank == self.comm.rank])
            report = ReplayReport(True)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the replay
            report = ReplayReport(False, f"{type(exc).__name__}: {exc}")
        finally:
            with self._cond:
                self._uploading -= 1
        raw, scope = messages.encode(report), messages.replay_scope(self.channel, self._seq)
        if self.comm.rank == 0:
            assert manifest is not None  # rank 0 holds the manifest it enqueued
            found, _ = gather.gather(self.comm, scope, raw, time.monotonic() + self.timeout_s)
            self._commit(attempt, manifest, found)
            return
        if self.comm.node.is_leader:
            gather.forward(self.comm, scope, raw, time.monotonic() + self.timeout_s)
        else:
            gather.post(self.comm, scope, raw)
        if self.groups is not None and self.groups.copies_by(self.comm.rank) and manifest_raw is not None:
            self._node_copy(attempt, manifest_raw)

    def _commit(self, attempt, manifest: Manifest, found: Collected) -> None:
        generation = attempt.generation
        errors = {f"rank {r}": f"no report before {self.timeout_name}" for r in found.missing}
        for rank, raw in found.received.items():
            report = messages.decode(ReplayReport, raw)
            if not report.ok:
                errors[f"rank {rank}"] = str(report.error)
        if not found.missing:  # every rank read the announcement: nobody reads it again
            try:
                self.comm.store.delete_key(messages.replay_seq_key(self.channel, self._seq))
            except Exception:  # noqa: BLE001 - a leftover key costs bytes, never correctness
                log.warning("could not delete the store keys of %s sequence %d", self.channel, self._seq)
        published = False
        offered: list[str] = []
        try:
            if errors:
                raise DistCkptError(f"{self.channel} replay of {generation} failed: {errors}")
            faults.hit(f"{self.channel}.before_publish", self.comm.rank)
            with self.publish_lock:
                self._check_objects(attempt, manifest)
                published_raw = attempt.publish(manifest, self.signing_key)
            published = True
            offered = self._offer_common(manifest)
            self._post_outcome(True)
            self._await_node_copies(generation)
            self.stats.completed.append(generation)
            self._record(completed=manifest)
        except Exception as exc:  # noqa: BLE001 - the destination lags; local training goes on
            log.error("%s replay of %s failed: %s", self.channel, generation, exc)
            if not published:
                self._post_outcome(False, f"{type(exc).__name__}: {exc}")
            self.stats.failed[generation] = str(exc)
            self._record(failed=generation, reason=str(exc))
        else:
            self._prune()
            self._hand_over(generation, published_raw)
        common_files.withdraw(self.comm, offered)  # every leader reported, or is too late
        with self._cond:
            self._active = None  # the settled generation no longer pins local retention
            self._publish_pinned()
        if self.on_settled is not None:
            self.on_settled()

    def _check_objects(self, attempt, manifest: Manifest) -> None:
        """Rank 0, before publishing: every shared object ``manifest`` lists is in the
        destination with its size, at its root (``objects/<name>``) or, in a rename tier, in the
        attempt's pending directory (installed by the publish before its rename)."""
        pending = open_store(attempt.local_dir) \
            if self.destination.shares_objects else None
        missing = [entry.path for entry in manifest.objects
                   if not (pending is not None and holds_object(pending, entry))
                   and not holds_object(self.destination.store, entry)]
        if missing:
            raise DistCkptError(f"{self.destination.url} lacks {len(missing)} shared object(s) that "
                                f"{manifest.generation} references ({', '.join(missing[:3])}"
                                f"{', ...' if len(missing) > 3 else ''}): not published")

    def _hand_over(self, generation: str, manifest_raw: bytes) -> None:
        if self.on_completed is None:
            return
        try:
            self.on_completed(generation, manifest_raw)
        except Exception:  # noqa: BLE001 - the next channel lags; this one goes on
            log.exception("%s replay: handing %s to the next channel failed", self.channel, generation)

    # ---- node copies (a destination with one copy per node) ---------------------------------
    def _post_outcome(self, ok: bool, error: str | None = None) -> None:
        if self.groups is not None:  # rank 0: the other nodes' leaders wait for it
            key = messages.replay_outcome_key(self.channel, self._seq)
            messages.post(self.comm, key, ReplayReport(ok, error))

    def _offer_common(self, manifest: Manifest) -> list[str]:
        """Rank 0, after publishing: the common files for the other nodes' copies."""
        if self.groups is None:
            return []
        store = self.destination.store
        return common_files.offer(self.comm, self.channel, self._seq, manifest,
                                  lambda path: store.read_bytes(manifest.where(path)))

    def _await_node_copies(self, generation: str) -> None:
        """Rank 0: the generation counts as replayed once every node holds its part."""
        if self.groups is None:
            return
        leaders = [r for r in self.groups.leaders if r != 0]
        keys = {r: messages.replay_copy_key(self.channel, self._seq, r) for r in leaders}
        found = messages.collect(self.comm, keys, time.monotonic() + self.timeout_s)
        errors = {r: f"no node copy before {self.timeout_name}" for r in found.missing}
        for rank, raw in found.received.items():
            report = messages.decode(ReplayReport, raw)
            if not report.ok:
                errors[rank] = str(report.error)
        if not found.missing:
            self.comm.store.delete_key(messages.replay_outcome_key(self.channel, self._seq))
        if errors:
            raise DistCkptError(f"{generation}: node copies missing or failed (by leader): {errors}")

    def _node_copy(self, attempt, manifest_raw: bytes) -> None:
        """The leader of a group without rank 0: once rank 0 published, this node's copy."""
        key = messages.replay_outcome_key(self.channel, self._seq)
        report = ReplayReport(False, f"rank 0 published no outcome before {self.timeout_name}")
        try:
            if not self.comm.store_wait([key], self.timeout_s + 30.0):
                outcome = messages.decode(ReplayReport, self.comm.store_get(key))
                if not outcome.ok:  # rank 0 waits for no copy of a generation it did not publish
                    attempt.abandon()
                    return
                common_files.install(self.comm, self.channel, self._seq,
                                     Manifest.model_validate_json(manifest_raw),
                                     os.path.join(self.local_root, attempt.generation), attempt.local_dir)
                faults.hit(f"{self.channel}.node_copy", self.comm.rank)
                attempt.publish_copy(manifest_raw)
                report = ReplayReport(True)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the replay
            report = ReplayReport(False, f"{type(exc).__name__}: {exc}")
        if not report.ok:
            attempt.abandon()
            log.error("%s replay: no node copy of %s: %s", self.channel, attempt.generation, report.error)
        messages.post(self.comm, messages.replay_copy_key(self.channel, self._seq, self.comm.rank), report)
        if report.ok and self.on_copied is not None:
            try:
                self.on_copied()
            except Exception:  # noqa: BLE001 - retention must never fail a replay or training
                log.exception("retention after the node copy of %s failed", attempt.generation)

    def _prune(self) -> None:
        if self.prune_destination is None:
            return
        try:
            self.prune_destination()
        except Exception:  # noqa: BLE001 - retention must never fail a replay or training
            log.exception("%s: the destination's retention pass failed", self.channel)

    def _record(self, *, completed: Manifest | None = None, skipped: str | None = None,
                failed: str | None = None, reason: str | None = None) -> None:
        update_record(self.source.store, self.local_root, self.channel, self.destination.url,
                      completed=completed, skipped=skipped, failed=failed, reason=reason)

    def drain(self, timeout_s: float) -> bool:
        """Rank 0: wait until the queue is empty and nothing is copied; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._active:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closing.set()  # under _cond: rank 0's queue wait checks it there
            self._cond.notify_all()
        self._thread.join(timeout_s)
