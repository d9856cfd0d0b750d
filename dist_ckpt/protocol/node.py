"""This rank's node: its members and leader, a node-local directory, and the job's bell.

Why: every rank of a job shares one c10d store, served by one thread. A message every rank
reads, or a key every rank polls, costs the store O(W) per event or per second; at thousands
of ranks that alone saturates it. So the ranks of one node share one reader of the store:

- **membership** (``Node.join``, every rank at ``Comm`` construction, collective: one
  all-gather of one integer per rank). Under torchrun a node's ranks are contiguous
  (``RANK - LOCAL_RANK`` leads ``LOCAL_WORLD_SIZE`` ranks); elsewhere the ranks with the same
  host name form a node. The leader is the node's lowest rank.
- **relay** (``relay_post`` by the leader, ``relay_wait`` by the others): a message the
  leader read from the store is written into the node directory (atomic rename); the other
  ranks of the node wait for the file (a ``stat``), never for the store. The waiting threads
  of one process share one look per round (``SharedLook``).
- **bell** (``ring`` by any rank that posts something ranks wait for idly: a replay
  announcement, a ring offer, a preemption target): one counter key for the job. Only the
  leader's watcher thread reads it: ``FAST_S`` after the bell changed or a local rank
  ``hint``-ed that a message is near, the interval doubling after each read up to
  ``IDLE_S`` (about seven reads per node per ring); it writes each new value into the node
  directory, where every local waiter looks (``Bell.wait``: a ``stat`` and a small read).

Idle, a job's store load from this module is one request per node per ``IDLE_S``.
Call order: ``Comm`` calls ``Node.join`` (all ranks); any thread may ``ring``, ``hint``,
``Bell.wait``; ``Comm.close`` calls ``Node.close`` (the leader stops its watcher and
removes the directory).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import logs

log = logs.get(__name__)

BELL_KEY = "bell"
FAST_S = 0.01  # the leader's first read after a ring or a hint; the interval then doubles
IDLE_S = 1.0  # ... up to this: at most one request per second per node while idle
LOCAL_POLL_S = 0.005  # local waiters' first look at the node directory, doubling to ...
LOCAL_POLL_MAX_S = 0.05  # ... this
HINT_POLL_S = 0.05  # the watcher's look for a local hint (a stat) between its store reads
RELAYS_KEPT = 64  # relay files the leader keeps before removing the oldest
# the longest a leader's close waits for its members to read its relays: they wait for them
# already (milliseconds when alive); one that died never will, and one that comes later
# reads the outcome from the store instead
CLOSE_WAIT_S = 5.0


@dataclass(frozen=True)
class NodeLayout:
    leader: int  # the node's lowest rank
    members: tuple[int, ...]  # the node's ranks, ascending
    leaders: tuple[int, ...]  # every node's leader, ascending (rank 0's node first)
    node_of: tuple[int, ...]  # each rank's node leader, by rank

    @property
    def nodes(self) -> int:
        return len(self.leaders)

    def members_of(self, leader: int) -> list[int]:
        return [rank for rank, lead in enumerate(self.node_of) if lead == leader]


def torchrun_leader(rank: int) -> tuple[int, int] | None:
    """(leader, node size) from torchrun's environment, None without it or when it does not
    describe this rank."""
    try:
        local_rank = int(os.environ["LOCAL_RANK"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        env_rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    if env_rank != rank or not 0 <= local_rank < local_world:
        return None
    return rank - local_rank, local_world


def layout_from(rank: int, gathered: list[tuple[int, int] | str]) -> NodeLayout:
    """Every rank's contribution -> this rank's node. A contribution is (leader, size) from
    torchrun, or the host name."""
    first: dict[str, int] = {}
    node_of = tuple(g[0] if isinstance(g, tuple) else first.setdefault(g, r)
                    for r, g in enumerate(gathered))
    leader = node_of[rank]
    members = tuple(r for r, lead in enumerate(node_of) if lead == leader)
    return NodeLayout(leader, members, tuple(sorted(set(node_of))), node_of)


class Node:
    """See the module docstring. ``store`` is the checkpoint ``Comm``'s namespaced store."""

    def __init__(self, store: object, rank: int, session: str, layout: NodeLayout, *,
                 watch: bool = True) -> None:
        """``watch=False`` (one process, no peers): the watcher starts at the first wait."""
        self.store = store
        self.rank = rank
        self.layout = layout
        self.directory = os.path.join(tempfile.gettempdir(), f"dist_ckpt-node-{session}-{layout.leader}")
        os.makedirs(self.directory, exist_ok=True)
        self.bell = Bell(self)
        self._relays: list[tuple[str, tuple[int, ...]]] = []  # posted, and who will read it
        self._watcher: BellWatcher | None = None
        self._closed = False
        if watch:
            self.watch()

    @property
    def is_leader(self) -> bool:
        return self.rank == self.layout.leader

    def ring(self) -> None:
        """Tell every node's watcher that something was posted (any rank, any thread)."""
        self.store.add(BELL_KEY, 1)  # type: ignore[attr-defined]
        self.hint()

    def hint(self) -> None:
        """This node's watcher should stay awake: a message is near (any local rank). Nothing
        once the node directory is gone (its leader closed: no watcher to wake)."""
        with contextlib.suppress(OSError):
            _write_atomic(os.path.join(self.directory, "hint"), b"")

    def relay_post(self, name: str, data: bytes, readers: Iterable[int] | None = None) -> None:
        """Leader: ``data`` for the node's other ranks under ``name`` (one writer per name);
        nothing once this leader closed (its members stop waiting then). ``readers``: the
        members that will read it (default: all), whom ``close`` waits for."""
        if self._closed:
            return
        _write_atomic(os.path.join(self.directory, name), data)
        members = [r for r in self.layout.members if r != self.rank]
        self._relays.append((name, tuple(r for r in members if readers is None or r in set(readers))))
        while len(self._relays) > RELAYS_KEPT:
            self._remove_relay(*self._relays.pop(0))

    def _remove_relay(self, name: str, readers: tuple[int, ...]) -> None:
        for path in [name, *(f"{name}.read-{rank}" for rank in readers)]:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, path))

    def _wait_read(self, timeout_s: float) -> None:
        """Leader, at close: until every member read every relay (a member still finishing
        its save reads the last one after the leader closed), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for name, readers in self._relays:
            for rank in readers:
                # read, or closed itself (its save gave up on the relay, or it never waits)
                while not os.path.exists(os.path.join(self.directory, f"{name}.read-{rank}")) \
                        and not os.path.exists(os.path.join(self.directory, f"closed-{rank}")):
                    if time.monotonic() >= deadline:
                        log.warning("closing before rank(s) of this node read %s", name)
                        return
                    time.sleep(0.01)

    def relay_wait(self, name: str, timeout_s: float) -> bytes | None:
        """Not the leader: the relayed message; None once ``timeout_s`` passed, or at once
        when this node is closed here or by its leader (nothing will be relayed then)."""
        path = os.path.join(self.directory, name)

        def ready() -> bool:
            # this rank closed its manager, or the leader closed and removed the directory
            return os.path.exists(path) or self._closed or not os.path.isdir(self.directory)

        shared_look(self.directory).wait(ready, time.monotonic() + timeout_s)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None
        # read: the leader may remove the directory at its close once all have read
        _write_atomic(f"{path}.read-{self.rank}", b"")
        return data

    def watch(self) -> None:
        """The leader's watcher thread, started once (other ranks: nothing to do)."""
        if self.is_leader and self._watcher is None and not self._closed:
            self._watcher = BellWatcher(self)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the watcher; the leader removes the directory once its relays were read
        (waiting at most ``wait_s``; a job that is failing passes 0)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.is_leader:
            self._wait_read(min(wait_s, CLOSE_WAIT_S))
            shutil.rmtree(self.directory, ignore_errors=True)
        elif os.path.isdir(self.directory):
            with contextlib.suppress(OSError):  # the leader's close need not wait for this rank
                _write_atomic(os.path.join(self.directory, f"closed-{self.rank}"), b"")


class Bell:
    """The bell as the node directory shows it (see the module docstring)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.path = os.path.join(node.directory, "bell")

    def value(self) -> int:
        try:
            with open(self.path, "rb") as handle:
                return int(handle.read() or b"0")
        except (FileNotFoundError, ValueError):
            return 0

    def wait(self, since: int, timeout_s: float, stop: threading.Event | None = None) -> int:
        """The bell's value once it differs from ``since``, else ``since`` after ``timeout_s``
        (or at once when ``stop`` is set). Reads the node directory only."""
        self.node.watch()
        shared_look(self.node.directory).wait(
            lambda: self.value() != since or (stop is not None and stop.is_set()),
            time.monotonic() + timeout_s)
        return self.value()


class SharedLook:
    """The threads of this process that wait on one node directory take turns looking at it.

    Why: a rank's waits (its outcome relay, its replay followers' and ring receiver's bell)
    would each poll a file every few milliseconds. One look per round for all of them keeps
    that cost per process, not per waiting thread; where one process holds several ranks of a
    node (the scale harness: thousands of simulated ranks as threads on two cores), it is
    what lets the leaders that post the node's reports get the CPU at all.

    Call order: any thread calls ``wait(ready, deadline)``. The first waiter without a looker
    becomes the looker: it evaluates every waiter's ``ready`` each round (the interval
    doubling from ``LOCAL_POLL_S`` to ``LOCAL_POLL_MAX_S``) and wakes them all when one holds;
    the others sleep on the condition until woken or their deadline. A looker whose own wait
    ends hands the role to the next waiter.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._waiting: dict[int, Callable[[], bool]] = {}
        self._looker: int | None = None
        self._next = 0

    def wait(self, ready: Callable[[], bool], deadline: float) -> bool:
        """True once ``ready()`` holds, False at ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            me, self._next = self._next, self._next + 1
            self._waiting[me] = ready
            interval = LOCAL_POLL_S
            try:
                while not ready():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    if self._looker is None:
                        self._looker, interval = me, LOCAL_POLL_S
                    if self._looker != me:
                        self._cond.wait(remaining)
                        continue
                    self._cond.wait(min(interval, remaining))
                    interval = min(interval * 2, LOCAL_POLL_MAX_S)
                    if any(other() for key, other in self._waiting.items() if key != me):
                        self._cond.notify_all()
                return True
            finally:
                del self._waiting[me]
                if self._looker == me:
                    self._looker = None
                    self._cond.notify_all()  # a waiter left takes the role over


_LOOKS: dict[str, SharedLook] = {}
_LOOKS_LOCK = threading.Lock()


def shared_look(directory: str) -> SharedLook:
    """This process's ``SharedLook`` of ``directory``."""
    with _LOOKS_LOCK:
        return _LOOKS.setdefault(directory, SharedLook())


class BellWatcher:
    """The leader's one reader of the bell key (a thread; see the module docstring)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dist-ckpt-bell")
        self._thread.start()

    def _run(self) -> None:
        node, hint = self.node, os.path.join(self.node.directory, "hint")
        seen, hint_mtime = -1, 0
        interval, next_read = FAST_S, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            with contextlib.suppress(FileNotFoundError):
                mtime = os.stat(hint).st_mtime_ns
                if mtime != hint_mtime:
                    hint_mtime, interval, next_read = mtime, FAST_S, now
            if now >= next_read:
                try:
                    value = int(node.store.add(BELL_KEY, 0))  # type: ignore[attr-defined]
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                    log.debug("bell watcher stopped", exc_info=True)
                    return
                if value != seen:
                    seen, interval = value, FAST_S
                    try:
                        _write_atomic(node.bell.path, str(value).encode())
                    except OSError:  # the node directory is gone: its leader is closing
                        return
                else:
                    interval = min(interval * 2, IDLE_S)
                next_read = now + interval
            self._stop.wait(min(HINT_POLL_S, max(0.0, next_read - time.monotonic())) or FAST_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def host_name() -> str:
    return os.uname().nodename
