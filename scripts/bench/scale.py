"""The scale phase (issue 41): the checkpoint protocol of thousands of simulated ranks against one
real c10d store, on this machine. Not a test.

``python -m scripts.bench --phases scale --ranks 256,1024,4096,16384 [--ranks-per-node 8]
[--items 100] [--scale-saves 2] [--scale-warmup 1] [--scale-workers 3] [--scale-budget-s 600]``

What runs, per case of W ranks (N = W / ranks-per-node nodes):

- a real ``TCPStore`` server (libuv) in a process of its own: the job's one store;
- the simulated ranks as W store client connections (one each) over client processes: rank 0
  alone in one, the others in ``--scale-workers`` processes of whole nodes, at nice 19, so that
  rank 0 and the server (each a machine or a core of its own in a real job) get the CPU first.
  Each rank is a thread of its process (thousands per process at 16,384 ranks), and at most
  ``scale_clients.RUN_TURNS`` of them run at once: a rank gives its turn up while it blocks
  (``scale_clients.Turns``: without it, hundreds of threads waking at once spend the cores
  fighting over the GIL). Every store request goes through ``CountingStore`` (in
  ``scale_clients``, with the collectives), which counts that rank's requests per kind and
  its payload bytes sent and received (keys and values; not the few bytes of framing per
  request);
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
for ``IDLE_S`` seconds, ``IDLE_WARMUP_S`` after their watchers started (node 0, with rank 0,
counted once; the other sampled nodes' mean times N - 1; the JSON has each role's requests
per second per rank by kind); the restore runs on one rank per role (rank 0, the last node's
leader and another of its ranks), every other rank contributing to the collectives what its
role's sampled rank does, and its store traffic is each sampled rank's times its role's count
(a restore in which ranks wait for one another's store keys needs every rank:
``role_sample``).

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
blocking path besides its agreement; the memory tier's restore (its holdings gather and
exchange); the replay channels' per-generation traffic (announcements, reports, common files)
and the memory ring's pushes and floor; a first save (planning): the warm-up saves are dropped; the
node leaders' bell watchers outside the idle phase (``scale_protocol``: each leader's reads of
the bell, about one a second plus a few after each commit, are the idle figure, not a save's).

Modules: this one is the controller (``Case``, ``run_case``, ``phase_scale``);
``scale_worker`` the store server's and the client processes' code; ``scale_clients`` the
counting store, the collectives and the turns, in every client process; ``scale_report`` the
table; ``scale_protocol`` the one seam with ``dist_ckpt``.

Debugging: ``SCALE_TRACEBACK=1`` prints a failed rank's traceback; ``SCALE_PROFILE=PATH`` writes
a cProfile of rank 0's ``rank_save`` per save to ``PATH.<update>``; ``SCALE_STACKS=PATH``: a
client process dumps its threads' stacks (the first 100) to ``PATH.<process>`` on SIGUSR1.
The JSON's ``setup_stages`` time each client process's setup (``prepare_process``, its
connections, its ``Comm`` objects).

Store setup: each client connection costs torch a reverse DNS lookup on both ends (of
``::ffff:127.0.0.1``), which a slow resolver stalls for its timeout; the harness's processes
run with ``RES_OPTIONS=timeout:1 attempts:1`` (unless set) and open their connections from a
pool of threads. Setup is not timed.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from . import scale_protocol as adapter
from .scale_clients import Broker
from .scale_report import DEFAULT_RANKS as DEFAULT_RANKS
from .scale_report import print_table as print_table
from .scale_worker import NotMeasured, cpu_seconds, meminfo, raise_nofile, serve_store, worker_main

# the idle window, after the bell watchers' start (their reads FAST_S apart, doubling to one a
# second, take about 2.3 s; more on a loaded machine): ten of a watcher's idle reads
IDLE_S = 10.0
IDLE_WARMUP_S = 4.0
IDLE_NODES = 4
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
    idle_warmup_s: float = IDLE_WARMUP_S
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
    """One rank per role (the highest: of the last node, which the idle phase did not sample,
    so that no watcher it started is counted in a restore), and each role's count."""
    counts = collections.Counter(adapter.rank_role(case, rank) for rank in range(case.world_size))
    sample: dict[str, int] = {}
    for rank in reversed(range(case.world_size)):
        sample.setdefault(adapter.rank_role(case, rank), rank)
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
        self.server = ctx.Process(target=serve_store, args=(server_end, case.world_size, case.nodes),
                                  daemon=True)
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
            proc = ctx.Process(target=worker_main, args=(index, ranks, case, self.port, cmd_end, coll_end),
                               daemon=True)
            proc.start()
            cmd_end.close()
            coll_end.close()
            self.procs.append(proc)
            self.cmds.append(cmd_here)
            colls.append(coll_here)
        self.broker = Broker(colls, case.world_size)
        self.setup_stages = self.ask(range(len(self.parts)), None, kind="ready")
        self.setup_s = max(stages["total"] for stages in self.setup_stages)

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
    time.sleep(case.idle_warmup_s)
    run.step = "idle: measuring"
    first = _each(run, procs, lambda i: ("idle_mark", local[i]))
    time.sleep(case.idle_s)
    last = _each(run, procs, lambda i: ("idle_mark", local[i]))
    run.step = "idle: stopping the watchers"
    _each(run, procs, lambda i: ("idle_stop", local[i]))
    per_node: collections.Counter[int] = collections.Counter()
    kinds: collections.defaultdict[str, collections.Counter[str]] = \
        collections.defaultdict(collections.Counter)
    for (t0, n0), (t1, n1) in zip(first, last, strict=True):
        for rank, counts in n1.items():
            for kind, count in counts.items():
                rate = (count - n0[rank].get(kind, 0)) / (t1 - t0)
                per_node[rank // case.ranks_per_node] += rate
                kinds[adapter.rank_role(case, rank)][kind] += rate
    others = [per_node[n] for n in range(1, nodes)]
    job = per_node[0] + (case.nodes - 1) * (statistics.mean(others) if others else 0.0)
    # requests per second per rank of each role, by kind (the sampled ranks' mean)
    sampled = collections.Counter(adapter.rank_role(case, rank) for rank in sample)
    by_role = {role: {kind: rate / sampled[role] for kind, rate in counter.items() if rate}
               for role, counter in kinds.items() if sampled[role]}
    return {"requests_per_s": job, "node0_per_s": per_node[0], "per_rank_by_kind": by_role,
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
        raise_nofile(case.world_size + case.nodes + 256)  # the server's (``serve_store``)
        run = _Run(case, ctx)
        row["setup_s"] = run.setup_s
        row["setup_stages"] = run.setup_stages
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
