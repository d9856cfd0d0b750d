"""The scale harness's client side, in every client process (``scale.py`` runs them): each
simulated rank's counted store connection (``CountingStore``), the collectives the ranks of a
process make through the controller (``Collectives``, ``Broker``, ``collective_result``), and
the turns that keep thousands of rank threads of one process from running at once (``Turns``).
Imports nothing from ``dist_ckpt``."""

from __future__ import annotations

import collections
import contextlib
import pickle
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

# simulated ranks of one process that run Python at once; the others wait for a turn
RUN_TURNS = 8


class Turns:
    """At most ``RUN_TURNS`` rank threads of this process run at once; a rank gives its turn up
    while it blocks (a collective, a blocking store wait, the gate, the arrival hold, a wait on
    its node directory) and waits for one to go on.

    Why: one process holds thousands of rank threads. When hundreds of them are runnable at
    once (a collective's result wakes them all), each waits for the GIL in 5 ms timed waits,
    and the futex storm of those wake-ups takes the two cores: at 16,384 ranks a save did not
    finish in minutes. Waiting for a turn is an untimed wait: no storm. No store request
    depends on it; only when a rank runs.

    Call order: a rank thread ``take``s a turn first and ``give``s it at its end; any code it
    runs wraps a blocking call in ``blocked()``, a no-op on threads without a turn (watchers,
    the controller's threads)."""

    def __init__(self, turns: int) -> None:
        self._free = threading.Semaphore(turns)
        self._local = threading.local()

    def take(self) -> None:
        self._free.acquire()
        self._local.held = True

    def give(self) -> None:
        if getattr(self._local, "held", False):
            self._local.held = False
            self._free.release()

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        held = getattr(self._local, "held", False)
        if held:
            self._local.held = False
            self._free.release()
        try:
            yield
        finally:
            if held:
                self._free.acquire()
                self._local.held = True


TURNS = Turns(RUN_TURNS)  # this process's (each client process has its own copy)


class CountingStore(dist.Store):
    """One simulated rank's store: a ``TCPStore`` client connection of its own, each request
    counted (``requests`` per kind, payload ``sent`` and ``received``). ``gate``: a rank holds
    one of the process's permits from a ``get`` to its next request (memory bound, ``GATE``).
    ``hold``: an event the rank's first request of a save (``hold_first``: rank 0) or its first
    request after its first write (the ranks that report) waits for (``Case.synchronized``);
    ``first_request`` and ``first_set`` are when the first request and the first write ran;
    ``on_first_set`` is called once, after the first write."""

    def __init__(self, client: dist.TCPStore, gate: threading.Semaphore, connect: Any = None,
                 counts_into: CountingStore | None = None) -> None:
        super().__init__()
        self._client = client
        self._gate = gate
        self._connect = connect
        self._parent = counts_into
        self._holding = False
        self._lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.received = 0
        self.hold: threading.Event | None = None
        self.hold_first = False
        self.first_request: float | None = None
        self.first_set: float | None = None
        self.on_first_set: Any = None

    def reset(self) -> None:
        self.hold = self.first_request = self.first_set = self.on_first_set = None
        self.hold_first = False

    def twin(self) -> CountingStore:
        """Another connection of this rank (``Comm.blocking_wait``'s), counted as this one."""
        return CountingStore(self._connect(0), self._gate, self._connect, counts_into=self)

    def _enter(self, get: bool = False) -> None:
        if self._parent is not None:
            self._parent._enter()
            return
        if self.hold is not None and (self.hold_first or self.first_set is not None):
            with TURNS.blocked():
                self.hold.wait()
            self.hold = None
        if self.first_request is None:
            self.first_request = time.monotonic()
        with self._lock:
            acquire, release = get and not self._holding, not get and self._holding
            self._holding = get
        if acquire:
            with TURNS.blocked():
                self._gate.acquire()
        if release:
            self._gate.release()

    def _count(self, kind: str, sent: int, received: int) -> None:
        if self._parent is not None:
            self._parent._count(kind, sent, received)
            return
        with self._lock:
            self.requests[kind] += 1
            self.sent += sent
            self.received += received

    def release_gate(self) -> None:
        with self._lock:
            holding, self._holding = self._holding, False
        if holding:
            self._gate.release()

    def snapshot(self) -> tuple[dict[str, int], int, int]:
        with self._lock:
            return dict(self.requests), self.sent, self.received

    # the c10d Store interface (PrefixStore calls these through torch's Python trampoline)
    def set(self, key: str, value: bytes) -> None:
        self._enter()
        self._client.set(key, value)
        self._count("set", len(key) + len(value), 0)
        if self.first_set is None:
            self.first_set = time.monotonic()
            if self.on_first_set is not None:
                self.on_first_set()

    def get(self, key: str) -> bytes:
        self._enter(get=True)
        value = self._client.get(key)
        self._count("get", len(key), len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._enter()
        value = self._client.add(key, amount)
        self._count("add", len(key) + 8, 8)
        return value

    def check(self, keys: list[str]) -> bool:
        self._enter()
        found = self._client.check(keys)
        self._count("check", sum(len(k) for k in keys), 1)
        return found

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._enter()
        value = self._client.compare_set(key, expected, desired)
        self._count("compare_set", len(key) + len(expected) + len(desired), len(value))
        return value

    def deleteKey(self, key: str) -> bool:  # noqa: N802 - the trampoline's name
        self._enter()
        deleted = self._client.delete_key(key)
        self._count("delete_key", len(key), 1)
        return deleted

    delete_key = deleteKey

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._enter(get=True)
        values = self._client.multi_get(keys)
        self._count("multi_get", sum(len(k) for k in keys), sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._enter()
        self._client.multi_set(keys, values)
        self._count("multi_set", sum(len(k) for k in keys) + sum(len(v) for v in values), 0)

    def append(self, key: str, value: bytes) -> None:
        self._enter()
        self._client.append(key, value)
        self._count("append", len(key) + len(value), 0)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._enter()
        with TURNS.blocked():
            if timeout is None:
                self._client.wait(keys)
            else:
                self._client.wait(keys, timeout)
        self._count("wait", sum(len(k) for k in keys), 0)

    def getNumKeys(self) -> int:  # noqa: N802 - the trampoline's name
        self._enter()
        self._count("num_keys", 0, 8)
        return self._client.num_keys()

    num_keys = getNumKeys

    def set_timeout(self, timeout: timedelta) -> None:
        self._client.set_timeout(timeout)


# ---- collectives ------------------------------------------------------------------------------
class Collectives:
    """The collectives of this process's simulated ranks: once every participating local rank
    called collective ``k`` of the phase, their objects go to the broker (``Broker``), which
    answers with each rank's result and the bytes it received; ``received`` sums them."""

    def __init__(self, conn: Connection, ranks: list[int]) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self.received: collections.Counter[int] = collections.Counter()
        self._local: set[int] = set(ranks)
        self._phase = 0
        self._seq: dict[int, int] = {}
        self._parts: dict[int, dict[int, Any]] = {}
        self._results: dict[tuple[int, int], dict[int, tuple[Any, int]]] = {}
        self._taken: collections.Counter[tuple[int, int]] = collections.Counter()
        self._waiters: dict[tuple[int, int], collections.deque[threading.Event]] = {}
        self.go = threading.Event()  # every report is in (``Case.synchronized``)
        threading.Thread(target=self._receive, daemon=True, name="collectives").start()

    def phase(self, phase: int, participants: list[int]) -> None:
        """A new phase: collective numbers restart; only ``participants`` take part."""
        with self._cond:
            self._phase, self._local = phase, set(participants)
            self._seq = {rank: 0 for rank in participants}
            self._parts.clear()

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                return
            if message == ("go",):
                self.go.set()
                continue
            phase, k, results = message
            with self._cond:
                self._results[(phase, k)] = results
                self._wake_next((phase, k))

    def _call(self, rank: int, op: str, obj: Any, root: int, frame: tuple[int, int] | None) -> Any:
        with TURNS.blocked():
            with self._cond:
                phase, k = self._phase, self._seq[rank]
                self._seq[rank] = k + 1
                part = self._parts.setdefault(k, {})
                part[rank] = obj
                if len(part) == len(self._local):
                    del self._parts[k]
                    with self._send_lock:
                        self._conn.send((phase, k, op, root, frame, part))
                woken = None
                if (phase, k) not in self._results:
                    woken = threading.Event()
                    self._waiters.setdefault((phase, k), collections.deque()).append(woken)
            if woken is not None:
                woken.wait()
            with self._cond:
                value, received = self._results[(phase, k)][rank]
                self._taken[(phase, k)] += 1
                if self._taken[(phase, k)] == len(self._local):
                    del self._results[(phase, k)], self._taken[(phase, k)]
                self.received[rank] += received
                self._wake_next((phase, k))
        return value

    def _wake_next(self, key: tuple[int, int]) -> None:
        """One waiter of collective ``key`` at a time (each wakes the next once it has its
        result): a wake-up of thousands at once is the storm ``Turns`` explains. Under
        ``_cond``."""
        waiters = self._waiters.get(key)
        if waiters:
            waiters.popleft().set()
            if not waiters:
                del self._waiters[key]

    def all_gather(self, rank: int, obj: Any, frame: tuple[int, int] | None = None) -> list[Any]:
        return self._call(rank, "all_gather", obj, 0, frame)

    def broadcast(self, rank: int, obj: Any, src: int) -> Any:
        return self._call(rank, "broadcast", obj, src, None)

    def gather(self, rank: int, obj: Any, dst: int) -> list[Any] | None:
        return self._call(rank, "gather", obj, dst, None)

    def scatter(self, rank: int, objs: list[Any] | None, src: int) -> Any:
        return self._call(rank, "scatter", objs, src, None)


def collective_result(op: str, root: int, frame: tuple[int, int] | None, values: dict[int, Any],
                      world: int, rep: list[int]) -> dict[int, tuple[Any, int]]:
    """Each participant's result of collective ``op`` and the bytes torch's gloo ``*_object``
    collective would make it receive. ``values``: the participants' objects; ``rep[r]``: the
    participant whose object rank ``r`` contributes (itself when it participates)."""
    sizes = {rank: len(pickle.dumps(obj)) for rank, obj in values.items()}
    largest = max(sizes.values())
    out: dict[int, tuple[Any, int]] = {}
    if op in ("all_gather", "gather"):
        full = [values[rep[r]] for r in range(world)]
        for rank in values:
            if op == "gather":
                got = (world - 1) * 8 + ((world - 1) * largest if rank == root else 0)
                out[rank] = (full if rank == root else None, got)
            elif frame is not None:  # PendingGather: fixed frames, all_gather_object if one overflows
                fits = largest <= frame[0] - frame[1]
                out[rank] = (full, (world - 1) * frame[0] + (0 if fits else (world - 1) * (8 + largest)))
            else:
                out[rank] = (full, (world - 1) * (8 + largest))
    elif op == "broadcast":
        for rank in values:
            out[rank] = (values[root], 0 if rank == root else 8 + sizes[root])
    elif op == "scatter":
        objs = values[root]
        each = max(len(pickle.dumps(obj)) for obj in objs)
        for rank in values:
            out[rank] = (objs[rank], 0 if rank == root else 16 + each)
    else:
        raise ValueError(f"unknown collective {op}")
    return out


class Broker:
    """This process's side of the collectives: one thread per client process collects its parts
    of collective ``k``; once every participating process sent its part, each gets its ranks'
    results (``collective_result``)."""

    def __init__(self, conns: list[Connection], world: int) -> None:
        self.conns = conns
        self.world = world
        self._lock = threading.Lock()
        self._phase = 0
        self._procs: set[int] = set()
        self._rep: list[int] = list(range(world))
        self._parts: dict[tuple[int, int], dict[int, tuple]] = {}
        self._send_locks = [threading.Lock() for _ in conns]
        self.error: str | None = None
        for index, conn in enumerate(conns):
            threading.Thread(target=self._serve, args=(index, conn), daemon=True, name="broker").start()

    def phase(self, phase: int, procs: set[int], rep: list[int]) -> None:
        with self._lock:
            self._phase, self._procs, self._rep = phase, set(procs), rep
            self._parts.clear()

    def send(self, index: int, message: tuple) -> None:
        with self._send_locks[index]:
            self.conns[index].send(message)

    def _serve(self, index: int, conn: Connection) -> None:
        while True:
            try:
                phase, k, op, root, frame, part = conn.recv()
            except (EOFError, OSError):
                return
            with self._lock:
                parts = self._parts.setdefault((phase, k), {})
                parts[index] = (op, root, frame, part)
                if len(parts) < len(self._procs):
                    continue
                del self._parts[(phase, k)]
                rep = self._rep
            try:
                values = {rank: obj for _, _, _, p in parts.values() for rank, obj in p.items()}
                results = collective_result(op, root, frame, values, self.world, rep)
                for proc, (_, _, _, p) in parts.items():
                    self.send(proc, (phase, k, {rank: results[rank] for rank in p}))
            except Exception:  # noqa: BLE001 - reported by the controller; the ranks time out
                self.error = traceback.format_exc()
