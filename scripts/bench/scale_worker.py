"""The scale harness's processes besides the controller (``scale.py`` starts them): the store
server (``serve_store``) and each client process (``worker_main``: its simulated ranks'
connections, ``Comm`` objects and threads, answering the controller's commands). Every call
into ``dist_ckpt`` goes through ``scale_protocol``."""

from __future__ import annotations

import collections
import os
import resource
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from . import scale_protocol as adapter
from .scale_clients import TURNS, Collectives, CountingStore

GATE = 16  # ranks of one process between a get and their next request (memory bound)
WORKER_NICE = 19
CONNECT_THREADS = 32
PROGRESS_S = 2.0


class NotMeasured(Exception):
    """The case could not finish (its budget, a resource limit, a failed rank)."""


# ---- the store server and the client processes -------------------------------------------------
def raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise NotMeasured(f"needs {needed} open files, the hard limit is {hard} (ulimit -Hn)")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else hard, hard))


def serve_store(conn: Connection, world: int, nodes: int) -> None:
    raise_nofile(world + nodes + 256)  # a connection per rank, and one per leader's blocking waits
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


class Worker:
    """A client process's state: its ranks' stores and comms (``worker_main`` runs it)."""

    def __init__(self, index: int, ranks: list[int], case: Any, port: int, cmd: Connection,
                 coll: Connection) -> None:
        self.index, self.ranks, self.case, self.cmd = index, ranks, case, cmd
        self.send_lock = threading.Lock()
        self.stages: dict[str, float] = {}  # setup's steps, seconds (the controller's JSON)
        began = time.monotonic()
        adapter.prepare_process(case, ranks, TURNS.blocked)
        self.stages["prepare"] = time.monotonic() - began
        self.collectives = Collectives(coll, ranks)
        gate = threading.Semaphore(GATE)
        timeout = timedelta(seconds=case.commit_timeout_s + 120)

        def connect(_: int) -> dist.TCPStore:
            return dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True,
                                 wait_for_workers=False, timeout=timeout)

        began = time.monotonic()
        with ThreadPoolExecutor(CONNECT_THREADS) as pool:
            clients = list(pool.map(connect, ranks))
        self.stages["connect"] = time.monotonic() - began
        self.stores = {rank: CountingStore(client, gate, connect)
                       for rank, client in zip(ranks, clients, strict=True)}
        began = time.monotonic()
        self.comms = {rank: adapter.make_comm(case, rank, self.stores[rank], self.collectives)
                      for rank in ranks}
        self.stages["comms"] = time.monotonic() - began
        self.watchers: dict[int, list[Any]] = {}
        self.marks: dict[int, tuple[dict[str, int], int, int]] = {}

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.cmd.send(message)

    def _threads(self, ranks: list[int], fn: Any) -> dict[int, Any]:
        """``fn(rank)`` for every rank of ``ranks`` at once, one thread each; their results."""
        results: dict[int, Any] = {}

        def run(rank: int) -> None:
            TURNS.take()
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported with the rank's figures
                if os.environ.get("SCALE_TRACEBACK"):
                    traceback.print_exc()
                results[rank] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            finally:
                self.stores[rank].release_gate()
                TURNS.give()

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

    def idle_mark(self, sample: list[int]) -> tuple[float, dict[int, dict[str, int]]]:
        now = time.monotonic()
        return now, {rank: self.stores[rank].snapshot()[0] for rank in sample}

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


def worker_main(index: int, ranks: list[int], case: Any, port: int, cmd: Connection,
                 coll: Connection) -> None:
    try:
        raise_nofile(len(ranks) + -(-len(ranks) // case.ranks_per_node) + 256)
        if os.environ.get("SCALE_STACKS"):  # SIGUSR1 dumps every thread's stack there
            import faulthandler
            import signal
            stacks = open(f"{os.environ['SCALE_STACKS']}.{index}", "w")  # noqa: SIM115 - for the process's life
            faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        if index > 0:  # inherited by every thread it starts
            os.nice(WORKER_NICE)
        threading.stack_size(1 << 20)
        started = time.monotonic()
        worker = Worker(index, ranks, case, port, cmd, coll)
        worker.send(("ready", {"total": time.monotonic() - started, **worker.stages,
                               "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
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
