"""The scale phase (issue 41): the checkpoint protocol of thousands of simulated ranks against one
real c10d store, on this machine. Not a test.

``python -m scripts.bench --phases scale --ranks 256,1024,4096,16384 [--ranks-per-node 8]
[--items 100] [--scale-saves 2] [--scale-warmup 1] [--scale-workers 3] [--scale-budget-s 600]``

What runs, per case of W ranks (N = W / ranks-per-node nodes):

- a real ``TCPStore`` server (libuv) in a process of its own: the job's one store;
- the simulated ranks as W store client connections (one each) over client processes: rank 0
  alone in one, the others in ``--scale-workers`` processes of whole nodes, at nice 19, so that
  rank 0 and the server (each a machine or a core of its own in a real job) get the CPU first.
  Each rank is a thread of its process. Every store request goes through ``CountingStore``,
  which counts that rank's requests per kind and its payload bytes sent and received (keys and
  values; not the few bytes of framing per request);
- the protocol code is the project's own, called through ``scale_protocol``: the only module of
  the harness that imports ``dist_ckpt``, and the only one to retarget when the protocol
  changes. Its docstring says what it drives and what it replaces (no shard, manifest or
  node-copy file is written; rank 0's DCP ``.metadata`` is, on tmpfs);
- collectives (the save agreement, a restore's broadcasts and all-gathers) cannot run on W gloo
  ranks here: ``Collectives`` moves the objects between the processes through this process
  (``Broker``, pipes, never the store) and counts for each rank the bytes torch's gloo
  ``*_object`` collectives would make it receive (pickled sizes padded to the largest, plus the
  size tensors; ``PendingGather``'s fixed frames for the save agreement).

Per case, in order: the idle store load; ``--scale-warmup`` saves, then ``--scale-saves``
measured saves; one restore's agreement. A save: every rank's ``rank_save`` at once, then every
rank's ``after_save`` (counted in that save). Arrival: every rank that reports
(``adapter.posts_report``) makes its first store write (its report) while the save waits
elsewhere: rank 0's first request, and each reporting rank's next one, wait until the last
report is in. On this machine's two cores, rank 0 polling W keys per round (today's protocol)
starves the processes that have to post the reports, and the arrival stretches to a minute
at 2,048 ranks (measured); in a real job every rank posts from its own machine. ``Case(
synchronized=False)`` lets everything run at once instead.

Printed per case (medians over the measured saves): rank 0's commit time (from its first store
request, once every report is in, to the end of its ``rank_save``: collection, ``.metadata``,
manifest, outcome), store requests and payload MB per save (every rank, ``after_save``
included), the most store bytes one rank other than rank 0 and the node leaders read per save
and the most any rank read, the store server's CPU per save (``/proc/<pid>/stat``), the job's
idle store requests per second, a restore's store MB and the most collective bytes one rank
receives in it, the most collective bytes one rank receives per save, and when the last rank
made its first store write (``arrivals``, from the save's start, its agreement included). The
JSON has each save's figures, requests per kind and per-role maxima.

Sampled, then scaled: the idle load is measured on the ranks of the first ``IDLE_NODES`` nodes
for ``IDLE_S`` seconds (node 0, with rank 0, counted once; the other sampled nodes' mean times
N - 1); the restore runs on one rank per role (rank 0, a node leader, another rank), every
other rank contributing to the collectives what its role's sampled rank does, and its store
traffic is each sampled rank's times its role's count (a restore in which ranks wait for one
another's store keys needs every rank: ``role_sample``).

Bounded: a case that runs past ``--scale-budget-s``, or during which this machine's available
memory falls below ``MEMORY_FLOOR`` (or an eighth of its RAM), ends and is printed as "not
measured: <why>", with what it had done (rank 0's time, the bytes read so far). Reads of
large values are limited to ``GATE`` ranks at a time per process (memory), which delays a
fan-out's tail, not its bytes.

Not simulated: the ranks' own work (staging, writing and hashing shards, DCP planning, DCP's
load and its collectives, the manifest's file I/O, publish's rename, fsyncs and size re-check,
``latest.json``, node copies' renames and manifest parse); gloo itself (its connections, its
use of the store at group creation, its transfer time); the network (loopback: no latency);
a machine per rank: two cores run the server, rank 0 and every simulated rank, so a waiting
rank polls less often than on its own core and request counts that depend on how long
something took (a rank polling for the outcome) are lower than a real job's; other users of
the job's store (torchrun's agent, NCCL bootstrap); failures and slow ranks; ``save()``'s
blocking path besides its agreement; the memory tier's restore (its holdings all-gather and
exchange); the replay channels' per-generation traffic (announcements, reports, common files)
and the memory ring's pushes; a first save (planning): the warm-up saves are dropped.

Debugging: ``SCALE_TRACEBACK=1`` prints a failed rank's traceback; ``SCALE_PROFILE=PATH`` writes
a cProfile of rank 0's ``rank_save`` per save to ``PATH.<update>``.

Store setup: each client connection costs torch a reverse DNS lookup on both ends (of
``::ffff:127.0.0.1``), which a slow resolver stalls for its timeout; the harness's processes
run with ``RES_OPTIONS=timeout:1 attempts:1`` (unless set) and open their connections from a
pool of threads. Setup is not timed.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import pickle
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from . import scale_protocol as adapter

DEFAULT_RANKS = (256, 1024, 4096)
IDLE_S = 4.0  # the idle window, after IDLE_WARMUP_S
IDLE_WARMUP_S = 0.5
IDLE_NODES = 4
GATE = 16  # ranks of one process between a get and their next request (memory bound)
WORKER_NICE = 19
CONNECT_THREADS = 32
PROGRESS_S = 2.0
MEMORY_FLOOR = 3 << 30  # a case ends ("not measured") once less is available (or 1/8 of RAM)


@dataclass
class Case:
    """One run of the harness; the adapter reads ``world_size``, ``ranks_per_node``, ``nodes``,
    ``items``, ``scratch``, ``session``, ``commit_timeout_s`` and ``restore_root``."""

    world_size: int
    ranks_per_node: int = 8
    items: int = 100
    saves: int = 2
    warmup: int = 1  # saves before the measured ones (first-use costs of each process)
    workers: int = 3
    idle_s: float = IDLE_S
    idle_nodes: int = IDLE_NODES
    budget_s: float = 600.0
    commit_timeout_s: float = 600.0
    # every rank that reports (``adapter.posts_report``) makes its first store write, then
    # the save goes on everywhere: rank 0's first request and the others' next ones wait for
    # the last report (module docstring: arrival); False: nothing waits
    synchronized: bool = True
    # each node's ranks share a node-local root (node copies); False: one root every rank sees
    node_local: bool = False
    scratch: str = ""
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    @property
    def restore_root(self) -> str:
        return os.path.join(self.scratch, "restore-root")


class NotMeasured(Exception):
    """The case could not finish (its budget, a resource limit, a failed rank)."""


# ---- the counting store (in every client process) ---------------------------------------------
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
            self.hold.wait()
            self.hold = None
        if self.first_request is None:
            self.first_request = time.monotonic()
        with self._lock:
            acquire, release = get and not self._holding, not get and self._holding
            self._holding = get
        if acquire:
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


# ---- collectives: the client side (in every client process) ------------------------------------
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
                self._cond.notify_all()

    def _call(self, rank: int, op: str, obj: Any, root: int, frame: tuple[int, int] | None) -> Any:
        with self._cond:
            phase, k = self._phase, self._seq[rank]
            self._seq[rank] = k + 1
            part = self._parts.setdefault(k, {})
            part[rank] = obj
            if len(part) == len(self._local):
                del self._parts[k]
                with self._send_lock:
                    self._conn.send((phase, k, op, root, frame, part))
            while (phase, k) not in self._results:
                self._cond.wait()
            value, received = self._results[(phase, k)][rank]
            self._taken[(phase, k)] += 1
            if self._taken[(phase, k)] == len(self._local):
                del self._results[(phase, k)], self._taken[(phase, k)]
            self.received[rank] += received
        return value

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


# ---- the store server and the client processes -------------------------------------------------
def _raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise NotMeasured(f"needs {needed} open files, the hard limit is {hard} (ulimit -Hn)")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))


def _serve_store(conn: Connection, world: int) -> None:
    _raise_nofile(world + 256)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timedelta(seconds=3600))
    try:
        conn.send(store.port)
        conn.recv()
    except (EOFError, OSError):  # the controller ended the case
        pass


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Worker:
    """A client process's state: its ranks' stores and comms (``_worker_main`` runs it)."""

    def __init__(self, index: int, ranks: list[int], case: Case, port: int, cmd: Connection,
                 coll: Connection) -> None:
        self.index, self.ranks, self.case, self.cmd = index, ranks, case, cmd
        self.send_lock = threading.Lock()
        adapter.prepare_process(case, ranks)
        self.collectives = Collectives(coll, ranks)
        gate = threading.Semaphore(GATE)
        timeout = timedelta(seconds=case.commit_timeout_s + 120)

        def connect(_: int) -> dist.TCPStore:
            return dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True,
                                 wait_for_workers=False, timeout=timeout)

        with ThreadPoolExecutor(CONNECT_THREADS) as pool:
            clients = list(pool.map(connect, ranks))
        self.stores = {rank: CountingStore(client, gate, connect)
                       for rank, client in zip(ranks, clients, strict=True)}
        self.comms = {rank: adapter.make_comm(case, rank, self.stores[rank], self.collectives)
                      for rank in ranks}
        self.watchers: dict[int, list[Any]] = {}
        self.marks: dict[int, tuple[dict[str, int], int, int]] = {}

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.cmd.send(message)

    def _threads(self, ranks: list[int], fn: Any) -> dict[int, Any]:
        """``fn(rank)`` for every rank of ``ranks`` at once, one thread each; their results."""
        results: dict[int, Any] = {}

        def run(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported with the rank's figures
                if os.environ.get("SCALE_TRACEBACK"):
                    traceback.print_exc()
                results[rank] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                self.stores[rank].release_gate()

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    def mark(self, ranks: list[int]) -> None:
        self.marks = {rank: self.stores[rank].snapshot() for rank in ranks}
        for rank in ranks:
            self.stores[rank].reset()

    def deltas(self, ranks: list[int]) -> dict[int, tuple[dict[str, int], int, int, int]]:
        """Per rank since ``mark``: requests per kind, bytes sent, bytes received, and the
        collective bytes received since the phase began."""
        out = {}
        for rank in ranks:
            kinds, sent, received = self.stores[rank].snapshot()
            kinds0, sent0, received0 = self.marks[rank]
            out[rank] = ({k: n - kinds0.get(k, 0) for k, n in kinds.items() if n != kinds0.get(k, 0)},
                         sent - sent0, received - received0, self.collectives.received[rank])
        return out

    def summary(self, ranks: list[int]) -> dict[str, Any]:
        """The figures of ``ranks`` since ``mark``, folded (the controller folds the processes')."""
        out: dict[str, Any] = {"requests": collections.Counter(), "sent": 0, "received": 0,
                               "max_read": {}, "max_coll": 0, "last_first_set": None}
        for rank, (kinds, sent, received, coll) in self.deltas(ranks).items():
            role = adapter.rank_role(self.case, rank)
            out["requests"].update(kinds)
            out["sent"] += sent
            out["received"] += received
            out["max_read"][role] = max(out["max_read"].get(role, 0), received)
            out["max_coll"] = max(out["max_coll"], coll)
            first = self.stores[rank].first_set
            if rank != 0 and first is not None:
                out["last_first_set"] = max(out["last_first_set"] or first, first)
        return out

    def save(self, phase: int, update: int, synchronized: bool) -> dict[str, Any]:
        self.collectives.phase(phase, self.ranks)
        self.collectives.received.clear()
        self.mark(self.ranks)
        # "posted" once every local rank that reports made its first store write (its report)
        reporters = [r for r in self.ranks if r != 0 and adapter.posts_report(self.case, r)]
        left, lock = [len(reporters)], threading.Lock()

        def posted() -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    self.send(("posted", None))

        self.collectives.go.clear()
        for rank in reporters:
            self.stores[rank].on_first_set = posted
            if synchronized:
                self.stores[rank].hold = self.collectives.go
        if not reporters:
            self.send(("posted", None))
        if 0 in self.stores and synchronized:
            self.stores[0].hold, self.stores[0].hold_first = self.collectives.go, True
        done = threading.Event()

        def progress() -> None:
            while not done.wait(PROGRESS_S):
                self.send(("progress", self.summary(self.ranks)))

        threading.Thread(target=progress, daemon=True).start()

        def one(rank: int) -> dict[str, Any]:
            if rank == 0 and os.environ.get("SCALE_PROFILE"):
                import cProfile
                prof = cProfile.Profile()
                result = prof.runcall(adapter.rank_save, self.comms[rank], self.case, update)
                prof.dump_stats(f"{os.environ['SCALE_PROFILE']}.{update}")
            else:
                result = adapter.rank_save(self.comms[rank], self.case, update)
            if rank == 0:
                began = self.stores[0].first_request
                result["commit_s"] = result["protocol_s"] if began is None else time.monotonic() - began
                self.send(("rank0", result))
            return result

        try:
            results = self._threads(self.ranks, one)
        finally:
            done.set()
        failed = {rank: r.get("error") for rank, r in results.items() if not r.get("ok")}
        return {"failed": len(failed), "error": next(iter(failed.values()), None),
                "rank0": results.get(0)}

    def retire(self) -> dict[str, Any]:
        for rank in self.ranks:
            adapter.after_save(self.comms[rank], self.case)
        return self.summary(self.ranks)

    def idle_start(self, sample: list[int]) -> None:
        for rank in sample:
            self.watchers[rank] = adapter.idle_watchers(self.comms[rank], self.case)

    def idle_mark(self, sample: list[int]) -> tuple[float, dict[int, int]]:
        now = time.monotonic()
        return now, {rank: sum(self.stores[rank].snapshot()[0].values()) for rank in sample}

    def idle_stop(self, sample: list[int]) -> None:
        self._threads(sample, lambda rank: adapter.stop_watchers(
            self.comms[rank], self.case, self.watchers.pop(rank)))

    def restore(self, phase: int, sample: list[int]) -> dict[int, Any]:
        self.collectives.phase(phase, sample)
        self.collectives.received.clear()
        self.mark(sample)
        results = self._threads(sample, lambda rank: adapter.rank_restore(self.comms[rank], self.case))
        failed = {rank: r["error"] for rank, r in results.items() if "error" in r}
        if failed:
            raise RuntimeError(f"restore failed: {failed}")
        return self.deltas(sample)


def _worker_main(index: int, ranks: list[int], case: Case, port: int, cmd: Connection,
                 coll: Connection) -> None:
    try:
        _raise_nofile(len(ranks) + 256)
        if index > 0:  # inherited by every thread it starts
            os.nice(WORKER_NICE)
        threading.stack_size(1 << 20)
        started = time.monotonic()
        worker = _Worker(index, ranks, case, port, cmd, coll)
        worker.send(("ready", time.monotonic() - started))
        while True:
            message = cmd.recv()
            kind, args = message[0], message[1:]
            if kind == "stop":
                for comm in worker.comms.values():
                    comm.close()
                return
            handler = {"save": worker.save, "retire": worker.retire, "idle_start": worker.idle_start,
                       "idle_mark": worker.idle_mark, "idle_stop": worker.idle_stop,
                       "restore_setup": lambda: adapter.restore_setup(case),
                       "restore": worker.restore}[kind]
            worker.send(("done", handler(*args)))
    except BaseException:  # noqa: BLE001 - the controller reports it and ends the case
        try:
            cmd.send(("error", traceback.format_exc()))
        except OSError:
            pass


# ---- the controller (this process) -------------------------------------------------------------
def partition(case: Case) -> list[list[int]]:
    """Rank 0 alone, then the other ranks in ``case.workers`` runs of whole nodes."""
    nodes = case.nodes
    per = -(-nodes // case.workers)
    parts = [[0]]
    for first in range(0, nodes, per):
        ranks = range(first * case.ranks_per_node, min((first + per) * case.ranks_per_node, case.world_size))
        parts.append([rank for rank in ranks if rank != 0])
    return [p for p in parts if p]


def role_sample(case: Case) -> tuple[list[int], collections.Counter[str]]:
    """One rank per role (the lowest), and each role's count."""
    counts = collections.Counter(adapter.rank_role(case, rank) for rank in range(case.world_size))
    sample: dict[str, int] = {}
    for rank in range(case.world_size):
        sample.setdefault(adapter.rank_role(case, rank), rank)
        if len(sample) == len(counts):
            break
    return sorted(sample.values()), counts


class _Run:
    """One case's processes and the calls to them, all bounded by the case's deadline."""

    def __init__(self, case: Case, ctx: Any) -> None:
        self.case = case
        self.deadline = time.monotonic() + case.budget_s
        self.step = "starting the store server"
        self.progress: dict[int, dict[str, Any]] = {}
        self.rank0: dict[str, Any] | None = None
        self.posted = 0
        self.save_began: tuple[float, float] | None = None  # (time, server CPU) of the save under way
        self.parts = partition(case)
        self.procs: list[Any] = []
        server_end, here = ctx.Pipe()
        self.server = ctx.Process(target=_serve_store, args=(server_end, case.world_size), daemon=True)
        self.server.start()
        server_end.close()  # only the child's: its end reads EOF when the child dies
        self.server_conn = here
        self.port = self._recv(here)
        self.step = f"connecting {case.world_size} store clients"
        self.cmds: list[Connection] = []
        colls: list[Connection] = []
        for index, ranks in enumerate(self.parts):
            cmd_end, cmd_here = ctx.Pipe()
            coll_end, coll_here = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(index, ranks, case, self.port, cmd_end, coll_end),
                               daemon=True)
            proc.start()
            cmd_end.close()
            coll_end.close()
            self.procs.append(proc)
            self.cmds.append(cmd_here)
            colls.append(coll_here)
        self.broker = Broker(colls, case.world_size)
        self.setup_s = max(self.ask(range(len(self.parts)), None, kind="ready"))

    def _recv(self, conn: Connection) -> Any:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or not conn.poll(remaining):
            raise NotMeasured(f"{self.step} did not finish within the budget of {self.case.budget_s:.0f} s")
        try:
            return conn.recv()
        except EOFError:
            raise NotMeasured(f"the store server ended during {self.step}") from None

    def ask(self, procs: Any, message: tuple | None, kind: str = "done") -> list[Any]:
        """Send ``message`` to ``procs`` (None: only wait) and wait for each one's answer."""
        procs = list(procs)
        if message is not None:
            for index in procs:
                self.cmds[index].send(message)
        answers: dict[int, Any] = {}
        waiting = {self.cmds[index]: index for index in procs}
        while waiting:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise NotMeasured(f"{self.step} did not finish within the budget of "
                                  f"{self.case.budget_s:.0f} s{self.partial()}")
            available = meminfo("MemAvailable")
            if available is not None and available < min(MEMORY_FLOOR, (meminfo("MemTotal") or 0) // 8):
                raise NotMeasured(f"{self.step}: this machine's available memory fell to "
                                  f"{available / (1 << 30):.1f} GiB (the simulated ranks' copies of "
                                  f"what they read){self.partial()}")
            ready = wait(list(waiting), timeout=min(remaining, 1.0))
            for conn in ready:
                index = waiting[conn]  # type: ignore[index]
                try:
                    got, value = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    raise NotMeasured(f"client process {index} ended during {self.step}") from None
                if got == "error":
                    raise NotMeasured(f"client process {index} failed during {self.step}:\n{value}")
                if got == "progress":
                    self.progress[index] = value
                elif got == "rank0":
                    self.rank0 = value
                elif got == "posted":
                    self.posted += 1
                    if self.posted == len(self.parts):
                        for index in range(len(self.parts)):
                            self.broker.send(index, ("go",))
                elif got == kind:
                    answers[index] = value
                    del waiting[conn]
        if self.broker.error:
            raise NotMeasured(f"the collectives failed during {self.step}:\n{self.broker.error}")
        return [answers[index] for index in procs]

    def partial_figures(self) -> dict[str, Any]:
        """What a save cut short had done: rank 0's time, the store bytes read so far."""
        out: dict[str, Any] = {"step": self.step}
        if self.rank0 is not None:
            out["rank0_commit_s"] = self.rank0["commit_s"]
        if self.progress:
            figures = _fold(list(self.progress.values()))
            out["store_read_bytes"] = figures["received"]
            out["store_bytes"] = figures["sent"] + figures["received"]
            out["store_requests"] = dict(figures["requests"])
        if self.save_began is not None:
            out["save_s"] = time.monotonic() - self.save_began[0]
            try:
                out["server_cpu_s"] = cpu_seconds(self.server.pid) - self.save_began[1]
            except OSError:  # the server is gone
                pass
        return out

    def partial(self) -> str:
        figures, text = self.partial_figures(), ""
        if "rank0_commit_s" in figures:
            text += f"; rank 0 finished its part in {figures['rank0_commit_s']:.1f} s"
        if "store_read_bytes" in figures:
            text += f"; the ranks had read {figures['store_read_bytes'] / 1e9:.2f} GB from the store"
        return text

    def close(self) -> None:
        for conn in self.cmds:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        try:
            self.server_conn.send("stop")
        except OSError:
            pass
        self.server.join(timeout=5)
        if self.server.is_alive():
            self.server.kill()


def _fold(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": collections.Counter(), "sent": 0, "received": 0, "max_read": {},
                           "max_coll": 0, "last_first_set": None}
    for s in summaries:
        out["requests"].update(s["requests"])
        out["sent"] += s["sent"]
        out["received"] += s["received"]
        for role, value in s["max_read"].items():
            out["max_read"][role] = max(out["max_read"].get(role, 0), value)
        out["max_coll"] = max(out["max_coll"], s["max_coll"])
        if s["last_first_set"] is not None:
            out["last_first_set"] = max(out["last_first_set"] or 0.0, s["last_first_set"])
    return out


def _saves(run: _Run) -> list[dict[str, Any]]:
    """``case.warmup`` saves, then ``case.saves`` measured ones (only these are returned)."""
    case, everyone = run.case, range(len(run.parts))
    saves = []
    for number in range(1, case.warmup + case.saves + 1):
        run.step, run.rank0, run.progress, run.posted = f"save {number}", None, {}, 0
        run.broker.phase(number, set(everyone), list(range(case.world_size)))
        cpu0, started = cpu_seconds(run.server.pid), time.monotonic()
        run.save_began = (started, cpu0)
        outcomes = run.ask(everyone, ("save", number, number, case.synchronized))
        run.step = f"save {number}: retiring its keys"
        figures = _fold(run.ask(everyone, ("retire",)))
        cpu1 = cpu_seconds(run.server.pid)
        run.save_began = None
        failed = sum(o["failed"] for o in outcomes)
        if failed:
            error = next(o["error"] for o in outcomes if o["error"])
            raise NotMeasured(f"save {number}: {failed} rank(s) failed, e.g. {error}")
        rank0 = next(o["rank0"] for o in outcomes if o["rank0"] is not None)
        last = figures["last_first_set"]
        saves.append({"rank0_s": rank0["commit_s"], "rank0_protocol_s": rank0["protocol_s"],
                      "wall_s": time.monotonic() - started,
                      "arrivals_s": None if last is None else last - started,
                      "requests": dict(figures["requests"]), "bytes": figures["sent"] + figures["received"],
                      "max_read": figures["max_read"], "coll_bytes": figures["max_coll"],
                      "server_cpu_s": cpu1 - cpu0, "warmup": number <= case.warmup})
    return [s for s in saves if not s["warmup"]]


def _idle(run: _Run) -> dict[str, Any]:
    case = run.case
    nodes = min(case.nodes, case.idle_nodes)
    sample = list(range(min(case.world_size, nodes * case.ranks_per_node)))
    local = {i: [r for r in ranks if r in set(sample)] for i, ranks in enumerate(run.parts)}
    procs = [i for i, ranks in local.items() if ranks]
    run.step = "idle: starting the watchers"
    for index in procs:
        run.cmds[index].send(("idle_start", local[index]))
    run.ask(procs, None)
    time.sleep(IDLE_WARMUP_S)
    run.step = "idle: measuring"
    first = _each(run, procs, lambda i: ("idle_mark", local[i]))
    time.sleep(case.idle_s)
    last = _each(run, procs, lambda i: ("idle_mark", local[i]))
    run.step = "idle: stopping the watchers"
    _each(run, procs, lambda i: ("idle_stop", local[i]))
    per_node: collections.Counter[int] = collections.Counter()
    for (t0, n0), (t1, n1) in zip(first, last, strict=True):
        for rank, count in n1.items():
            per_node[rank // case.ranks_per_node] += (count - n0[rank]) / (t1 - t0)
    others = [per_node[n] for n in range(1, nodes)]
    job = per_node[0] + (case.nodes - 1) * (statistics.mean(others) if others else 0.0)
    return {"requests_per_s": job, "node0_per_s": per_node[0],
            "other_node_per_s": statistics.mean(others) if others else None, "sampled_nodes": nodes}


def _each(run: _Run, procs: list[int], message: Any) -> list[Any]:
    for index in procs:
        run.cmds[index].send(message(index))
    return run.ask(procs, None)


def _restore(run: _Run) -> dict[str, Any]:
    case = run.case
    run.step = "restore: writing the generation"
    run.ask([0], ("restore_setup",))
    sample, counts = role_sample(case)
    role_of = {adapter.rank_role(case, rank): rank for rank in sample}
    rep = [role_of[adapter.rank_role(case, rank)] for rank in range(case.world_size)]
    local = {i: [r for r in ranks if r in set(sample)] for i, ranks in enumerate(run.parts)}
    procs = [i for i, ranks in local.items() if ranks]
    run.step = "restore"
    run.broker.phase(case.saves + 1, set(procs), rep)
    answers = _each(run, procs, lambda i: ("restore", case.saves + 1, local[i]))
    per_rank = {rank: figures for answer in answers for rank, figures in answer.items()}
    store_bytes = requests = 0
    for rank, (kinds, sent, received, _) in per_rank.items():
        count = counts[adapter.rank_role(case, rank)]
        store_bytes += count * (sent + received)
        requests += count * sum(kinds.values())
    return {"store_bytes": store_bytes, "store_requests": requests,
            "coll_bytes_max": max(coll for *_, coll in per_rank.values()),
            "coll_bytes_by_role": {adapter.rank_role(case, r): f[3] for r, f in per_rank.items()}}


def run_case(case: Case, ctx: Any = None) -> dict[str, Any]:
    """One case; ``not_measured`` says why when it could not finish (and what it had done)."""
    ctx = ctx or context()
    started = time.monotonic()
    own_scratch = not case.scratch
    if own_scratch:
        tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
        case.scratch = tempfile.mkdtemp(prefix="dist-ckpt-scale-", dir=tmpfs)
    row: dict[str, Any] = {"ranks": case.world_size, "nodes": case.nodes, "case": asdict(case),
                           "protocol": adapter.PROTOCOL, "source": adapter.SOURCE, "not_measured": None}
    run = None
    try:
        _raise_nofile(max(len(p) for p in partition(case)) + 256)
        run = _Run(case, ctx)
        row["setup_s"] = run.setup_s
        row["walls_s"] = walls = {"setup": time.monotonic() - started}
        for name, step in (("idle", _idle), ("saves", _saves), ("restore", _restore)):
            began = time.monotonic()
            row[name] = step(run)
            walls[name] = time.monotonic() - began
    except NotMeasured as exc:
        row["not_measured"] = str(exc)
        if run is not None:
            row["partial"] = run.partial_figures()
    finally:
        if run is not None:
            run.close()
        if own_scratch:
            shutil.rmtree(case.scratch, ignore_errors=True)
    row["wall_s"] = time.monotonic() - started
    if row.get("saves"):
        row.update(_medians(row["saves"]))
    return row


def _medians(saves: list[dict[str, Any]]) -> dict[str, Any]:
    def med(fn: Any) -> float:
        return statistics.median(fn(s) for s in saves)

    return {"rank0_commit_s": med(lambda s: s["rank0_s"]),
            "store_requests": med(lambda s: sum(s["requests"].values())),
            "store_bytes": med(lambda s: s["bytes"]),
            "max_read_other": med(lambda s: s["max_read"].get("other", 0)),
            "max_read_any": med(lambda s: max(s["max_read"].values())),
            "server_cpu_s": med(lambda s: s["server_cpu_s"]),
            "coll_bytes": med(lambda s: s["coll_bytes"]),
            "arrivals_s": med(lambda s: s["arrivals_s"] or 0.0)}


def context() -> Any:
    """A forkserver that imported torch and the harness once, so that client processes start
    in milliseconds. It starts with this process's ``sys.path`` (Python 3.11's forkserver
    ignores it otherwise), less c10d logging and a short resolver timeout (module docstring:
    store setup); this process's environment is left as it was."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, adapter.__name__])
    wanted = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
              "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"),
              "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return ctx


# ---- output ------------------------------------------------------------------------------------
HEADER = ("ranks", "rank 0 commit s", "store req/save", "store MB/save", "max read other/save",
          "max read any/save", "server CPU s/save", "idle req/s (job)", "restore store MB",
          "coll/rank/save", "restore coll/rank", "arrivals s")


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One line per case: ``HEADER``'s cells ("-": not measured), then why, if anything was not."""
    out = []
    for row in rows:
        saved, idle, restore = "rank0_commit_s" in row, row.get("idle"), row.get("restore")
        rank0 = row.get("rank0_commit_s", row.get("partial", {}).get("rank0_commit_s"))

        def cell(text: str, measured: bool = saved) -> str:
            return text if measured else "-"

        get = row.get
        cells = [str(row["ranks"]), "-" if rank0 is None else f"{rank0:.3f}",
                 cell(f"{get('store_requests', 0):.0f}"), cell(f"{get('store_bytes', 0) / 1e6:.1f}"),
                 cell(human_bytes(get("max_read_other", 0))), cell(human_bytes(get("max_read_any", 0))),
                 cell(f"{get('server_cpu_s', 0):.2f}"),
                 "-" if idle is None else f"{idle['requests_per_s']:.0f}",
                 "-" if restore is None else f"{restore['store_bytes'] / 1e6:.2f}",
                 cell(human_bytes(row.get("coll_bytes", 0))),
                 "-" if restore is None else human_bytes(restore["coll_bytes_max"]),
                 cell(f"{row.get('arrivals_s', 0):.2f}")]
        if row["not_measured"]:
            cells.append(f"not measured: {row['not_measured']}")
        out.append(cells)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    case = rows[0]["case"]
    print(f"\n---- scale: {case['ranks_per_node']} simulated ranks per node, {case['items']} state-dict "
          f"items per rank, {'node-local roots' if case.get('node_local') else 'one shared root'}, "
          f"{case['saves']} saves per case after {case['warmup']} warm-up (medians); "
          f"protocol {rows[0]['protocol']} ({rows[0]['source']}) ----")
    body = table_rows(rows)
    widths = [max(len(HEADER[i]), *(len(r[i]) for r in body)) for i in range(len(HEADER))]
    print("  ".join(h.rjust(w) for h, w in zip(HEADER, widths, strict=True)))
    for cells in body:
        line = "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=False))
        print(line if len(cells) == len(HEADER) else f"{line}\n      {cells[-1]}")
    print("store bytes are payload (keys and values); 'other' = neither rank 0 nor a node leader; "
          "coll = bytes gloo would move to one rank; arrivals = last rank's first store write "
          "after the save began (scripts/bench/scale.py)")


def phase_scale(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The scale phase: every case of ``cfg['ranks']``, printed as it ends."""
    rows = []
    ctx = context()
    for world in cfg["ranks"]:
        case = Case(world, ranks_per_node=cfg["ranks_per_node"], items=cfg["items"],
                    saves=cfg["scale_saves"], warmup=cfg["scale_warmup"], workers=cfg["scale_workers"],
                    budget_s=cfg["scale_budget_s"], node_local=cfg.get("scale_node_local", False))
        row = run_case(case, ctx)
        rows.append(row)
        status = row["not_measured"] or f"rank 0 {row['rank0_commit_s']:.3f} s"
        print(f"[bench] scale {world} ranks: {row['wall_s']:.0f} s ({status})", flush=True)
    return rows
