"""Checkpoint-side communication, kept off the training process group.

Foreground collectives (agreement at ``save()``, planning, restore) run on a dedicated gloo
group created once by :class:`Comm` (all ranks construct it together). Background work never
runs a collective: ranks report through the c10d store, whose waits take deadlines and
poison nothing when they time out. Groups for one purpose (the memory tier's peer channel:
point-to-point file transfers between node leaders) come from :meth:`Comm.new_group`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import logs
from .node import Node, host_name, layout_from, torchrun_leader

log = logs.get(__name__)

MIN_BLOCKING_S = 0.05  # shorter deadlines poll (Comm.blocking_wait)
GLOO_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


def poll_until(done: Callable[[], bool], deadline: float, *, first_s: float = 0.002,
               max_s: float = 0.05) -> bool:
    """Call ``done`` until it returns True (then True) or ``deadline`` (``time.monotonic()``)
    passes (then False), sleeping ``first_s`` after the first call, doubling up to ``max_s``:
    quick when the answer is near, a few requests per second when it is not."""
    interval = first_s
    while not done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval, remaining))
        interval = min(interval * 2, max_s)
    return True


@contextlib.contextmanager
def lazy_gloo() -> Iterator[None]:
    """Gloo groups created meanwhile connect a pair of ranks on its first use, not every pair
    at creation (``TORCH_GLOO_LAZY_INIT``, read when a group is created): the checkpoint
    group's collectives touch few pairs per rank, and a full mesh of W ranks is O(W²)
    connections made through the job's store at start-up. A value the user set is kept."""
    if GLOO_LAZY_ENV in os.environ:
        yield
        return
    os.environ[GLOO_LAZY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(GLOO_LAZY_ENV, None)


def current_rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Comm:
    """Rank identity, a dedicated gloo group and a namespaced c10d store.

    Call order: construct on all ranks at the same point (collective); afterwards the
    collective helpers are called by all ranks in the same order, from the main thread only.
    """

    def __init__(self, timeout_s: float = 1800.0) -> None:
        self.rank, self.world_size = current_rank_and_world()
        self.timeout_s = timeout_s  # of the group's collectives: the bound of a restore
        self.distributed = self.world_size > 1 or (dist.is_available() and dist.is_initialized())
        if self.distributed:
            # a rank may sit in a foreground all-gather while a peer blocks on its oldest save
            with lazy_gloo():
                self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            base_store = dist.distributed_c10d._get_default_store()
        else:
            self.group = None
            base_store = dist.HashStore()
        session = self.broadcast(uuid.uuid4().hex[:12])
        self.session = session
        self.namespace = f"dist_ckpt/{session}/"  # every key of this Comm's, on any connection
        self.store = dist.PrefixStore(self.namespace, base_store)
        self._base_store = base_store
        self._waits = WaitConnections(self)
        contribution = torchrun_leader(self.rank) or host_name()
        self.node = Node(self.store, self.rank, session,
                         layout_from(self.rank, self.all_gather(contribution)), watch=self.distributed)
        self.fs_leader = 0
        self.fs_group = list(range(self.world_size))
        self.fs_groups = 1  # how many filesystem groups the job has
        self.root_group_has_rank0 = True
        self._groups: list[Any] = []  # new_group's, destroyed by close
        self._probes = 0

    def new_group(self, ranks: list[int], timeout_s: float, backend: str = "gloo") -> Any:
        """A process group of ``ranks`` for one purpose (all ranks call it, in the same order,
        whether members or not: torch requires it). Returns the group on its members, None
        elsewhere and when not distributed. ``close`` destroys it."""
        if not self.distributed:
            return None
        with lazy_gloo():
            group = dist.new_group(ranks=sorted(ranks), backend=backend, timeout=timedelta(seconds=timeout_s))
        if self.rank not in ranks:
            return None
        self._groups.append(group)
        return group

    def probe_shared_root(self, root: str) -> None:
        """Find which ranks see the same ``root`` (all ranks, collective; ``probe_group``).
        Ranks sharing a filesystem form a group led by its lowest rank: the leader publishes
        that group's copy of each generation. Sets ``fs_group``, ``fs_leader``, ``fs_groups``
        and ``root_group_has_rank0``."""
        self.fs_group, self.fs_groups = self.probe_group(root)
        self.fs_leader = self.fs_group[0]
        self.root_group_has_rank0 = 0 in self.fs_group

    def probe_group(self, directory: str) -> tuple[list[int], int]:
        """The ranks that see the same ``directory`` as this rank, and how many such groups
        the job has (all ranks, collective).

        Rank 0 drops a marker; after a barrier each rank looks for it (one ``stat``) and an
        all-gather of one flag per rank tells everyone who sees it. When every rank does, they
        form one group and nobody lists the directory. Otherwise every rank drops its own
        marker and the ranks that do not see rank 0's list the ones they see (on node-local
        disks: their node's), never a directory of W entries.
        """
        self._probes += 1  # every rank probes in the same order: the same name everywhere
        prefix = f".probe-{self.session}-{self._probes}-"
        first = os.path.join(directory, f"{prefix}0")
        if self.rank == 0:
            with open(first, "wb"):
                pass
        self.barrier()
        sees_rank0 = self.all_gather(os.path.exists(first))
        mine = None
        if all(sees_rank0):
            group, groups = list(range(self.world_size)), 1
        else:
            mine = os.path.join(directory, f"{prefix}{self.rank}") if self.rank != 0 else None
            if mine is not None:
                with open(mine, "wb"):
                    pass
            self.barrier()
            if sees_rank0[self.rank]:
                group = [r for r, sees in enumerate(sees_rank0) if sees]
            else:
                group = sorted(int(n[len(prefix):]) for n in os.listdir(directory)
                               if n.startswith(prefix) and n[len(prefix):].isdigit())
            groups = len(set(self.all_gather(group[0])))
        self.barrier()  # every look done: the markers go
        for marker in (first if self.rank == 0 else None, mine):
            if marker is not None:
                os.unlink(marker)
        return group, groups

    def barrier(self) -> None:
        """All ranks: return once every rank reached this point (on the checkpoint group,
        with its timeout; gloo's barrier has none of its own)."""
        self.all_gather(None)

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_gather_start(self, obj: Any) -> PendingGather:
        """Start an all-gather of a small object and return at once (all ranks, main thread,
        in the same order as the other collectives); ``PendingGather.wait`` ends it. The
        caller may work while peers arrive: ``save()`` copies into staging meanwhile."""
        return PendingGather(self, obj)

    def broadcast(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """``src``'s object, on every rank of ``group`` (default: the checkpoint group)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group if group is not None else self.group)
        return box[0]

    def gather(self, obj: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
        """Every rank's object of ``group`` (default: the checkpoint group), in its rank
        order, on ``dst`` only (global ranks); None elsewhere."""
        if not self.distributed:
            return [obj]
        size = dist.get_world_size(group) if group is not None else self.world_size
        out: list[Any] | None = [None] * size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=group if group is not None else self.group)
        return out

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        if not self.distributed:
            assert objs is not None
            return objs[0]
        box: list[Any] = [None]
        dist.scatter_object_list(box, objs if self.rank == src else None, src=src, group=self.group)
        return box[0]

    def store_set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def store_wait(self, keys: list[str], timeout_s: float) -> list[str]:
        """Wait until every key exists or the deadline passes; returns the keys still missing.

        Polls ``check`` instead of a blocking ``wait``: a TCPStore ``wait`` that times out
        leaves its reply pending on the client socket and desynchronises later calls.
        """
        pending = list(keys)

        def arrived() -> bool:
            pending[:] = [k for k in pending if not self.store.check([k])]
            return not pending

        poll_until(arrived, time.monotonic() + max(timeout_s, 0.0))
        return pending

    def blocking_wait(self, keys: list[str], timeout_s: float) -> list[str]:
        """Like ``store_wait``, in one request: a blocking ``wait`` on a store connection
        that no other thread uses meanwhile (``WaitConnections``). For the ranks that wait on
        many keys or on a verdict while a save runs (rank 0, the node leaders): their polling,
        one request per round each, would load the store in proportion to the nodes for as
        long as the save takes.

        A wait that times out (or a lost connection) closes its connection, so that a reply to
        the cancelled wait can never answer a later request; the keys still missing are then
        found with one ``check`` each (a failure path). Where the store cannot open another
        connection (a Python ``Store``), and for deadlines under ``MIN_BLOCKING_S`` (a
        ``wait`` of zero would wait for ever), it polls as ``store_wait`` does."""
        if not keys:
            return []
        connection = self._waits.take() if timeout_s >= MIN_BLOCKING_S else None
        if connection is None:
            return self.store_wait(keys, timeout_s)
        try:
            connection.wait(keys, timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - a timeout, or the connection failed
            return [key for key in keys if not self.store.check([key])]
        self._waits.give_back(connection)
        return []

    def new_wait_connection(self) -> Any:
        """A new connection to the job's store under this ``Comm``'s namespace (``clone``: a
        TCPStore opens another socket; a HashStore shares its map)."""
        return dist.PrefixStore(self.namespace, self._base_store.clone())

    def store_get(self, key: str) -> bytes:
        return self.store.get(key)

    def publish_names(self, key: str, names: Iterable[str]) -> None:
        """Replace ``key`` with a set of names, for :meth:`read_names` on any rank."""
        self.store.set(key, json.dumps(sorted(names)).encode())

    def read_names(self, key: str) -> frozenset[str]:
        """The names last published under ``key``; empty when none were or the store fails
        (logged): callers use them to keep things, so missing names keep less, never more."""
        try:
            if self.store.check([key]):
                return frozenset(json.loads(self.store.get(key)))
        except Exception:  # noqa: BLE001 - see the docstring
            log.warning("could not read %s from the c10d store", key)
        return frozenset()

    def close(self, wait_s: float = 10.0) -> None:
        """Destroy the checkpoint group (local, no collective; idempotent). A node leader
        first waits (at most ``wait_s``) for its node's ranks to read what it relayed.

        The group object is released here, not at interpreter exit: freeing it joins its gloo
        worker threads (torch releases the GIL for that), so none is left to drop a finished
        collective during finalisation, where taking the GIL kills the thread inside a
        noexcept destructor (std::terminate, SIGABRT). A job that destroyed the default group
        first has shut ours down with it; then only the reference is dropped.
        """
        self.node.close(wait_s)
        self._waits.close()
        groups, self._groups = [*self._groups, self.group], []
        self.group = None
        while groups:
            group = groups.pop()
            if group is None:
                continue
            if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
            del group  # the last reference: the C++ group is destroyed now


class WaitConnections:
    """Store connections for ``Comm.blocking_wait``: one per waiting thread at a time, kept
    for the next wait (opening one costs a connect and the store's handshake). Any thread."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self._possible = True

    def take(self) -> Any:
        """A connection of the caller's alone until ``give_back``; None when this store
        opens none."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if not self._possible:
                return None
        try:
            return self.comm.new_wait_connection()
        except Exception:  # noqa: BLE001 - this store opens no second connection: callers poll
            log.debug("no store connection of its own for blocking waits", exc_info=True)
            self._possible = False
            return None

    def give_back(self, connection: Any) -> None:
        with self._lock:
            self._free.append(connection)

    def close(self) -> None:
        """Drop the free connections (one still in a wait goes when its waiter drops it)."""
        with self._lock:
            self._free.clear()


class PendingGather:
    """An all-gather in flight: one collective of fixed-size byte frames.

    Every rank's object is pickled into a frame of ``FRAME_BYTES``; a rank whose object does
    not fit marks its frame, and once the frames are in every rank sees the mark and all
    of them repeat the gather with ``all_gather_object`` (the same decision everywhere).
    """

    FRAME_BYTES = 512  # a SaveFacts pickles to about 200-300 bytes; a larger one gathers again
    _HEADER = struct.Struct("<q")  # payload length, or -1: did not fit

    def __init__(self, comm: Comm, obj: Any) -> None:
        self.comm = comm
        self.obj = obj
        self._frames: list[torch.Tensor] = []
        self._work: Any = None
        if not comm.distributed:
            return
        payload = pickle.dumps(obj)
        fits = len(payload) <= self.FRAME_BYTES - self._HEADER.size
        buffer = bytearray(self.FRAME_BYTES)
        self._HEADER.pack_into(buffer, 0, len(payload) if fits else -1)
        if fits:
            buffer[self._HEADER.size:self._HEADER.size + len(payload)] = payload
        frame = torch.frombuffer(buffer, dtype=torch.uint8)
        self._frames = [torch.empty_like(frame) for _ in range(comm.world_size)]
        self._work = dist.all_gather(self._frames, frame, group=comm.group, async_op=True)

    def wait(self) -> list[Any]:
        """Every rank's object, by rank (all ranks)."""
        if self._work is None:
            return [self.obj]
        self._work.wait()
        out: list[Any] = []
        for frame in self._frames:
            raw = frame.numpy().tobytes()
            (length,) = self._HEADER.unpack_from(raw)
            if length < 0:  # some rank's object was too large: everyone gathers again
                return self.comm.all_gather(self.obj)
            out.append(pickle.loads(raw[self._HEADER.size:self._HEADER.size + length]))
        return out
