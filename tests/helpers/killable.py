"""Multi-rank scenarios in which a rank may die: ``run_ranks`` for the fault matrix.

``dist_ckpt.testing.run_ranks`` joins every rank and raises when one fails, which also takes
the survivors down. Here each rank runs ``fn(rank, world, *args)`` in a process of its own
on a gloo group and writes its return value; a rank that is SIGKILLed simply has none. After
``fn`` no collective runs (a peer may be dead), so survivors exit on their own. Ranks start
from ``dist_ckpt.testing.rank_context`` (forked from a server with torch imported).

Call order: ``spawn(world, fn, *args)`` -> ``Ranks``; optionally ``ranks.kill(r)`` or
``ranks.wait_file(...)``; ``ranks.join(timeout_s)`` -> ``[Outcome(exitcode, result)]``.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dist_ckpt.testing import enter_rank, held_store, join_store, rank_context, rank_environment


@dataclass
class Outcome:
    exitcode: int | None  # None: still running at the join deadline (then killed)
    result: Any = None  # fn's return value; None when the rank died first


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple,
           timeout_s: float, inherited: tuple[dict[str, str], str]) -> None:
    enter_rank(inherited)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.enable(all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(os.path.join(out_dir, f"pid{rank}"), "w") as handle:
        handle.write(str(os.getpid()))
    join_store()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    result = fn(rank, world, *args)
    with open(os.path.join(out_dir, f"rank{rank}.pkl.tmp"), "wb") as handle:
        pickle.dump(result, handle)
    os.replace(os.path.join(out_dir, f"rank{rank}.pkl.tmp"), os.path.join(out_dir, f"rank{rank}.pkl"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no barrier, no group teardown: a peer may be gone


class Ranks:
    def __init__(self, world: int, fn: Callable, args: tuple, timeout_s: float) -> None:
        self.out_dir = tempfile.mkdtemp(prefix="killable-")
        context = rank_context()
        self.rendezvous = ExitStack()  # listening until join: a killed rank 0 does not take it along
        port, inherited = self.rendezvous.enter_context(held_store(timeout_s)), rank_environment()
        self.processes = [context.Process(target=_entry, args=(rank, world, port, self.out_dir, fn, args,
                                                                timeout_s, inherited), daemon=False)
                          for rank in range(world)]
        for process in self.processes:
            process.start()

    def pid(self, rank: int, timeout_s: float = 60.0) -> int:
        path = os.path.join(self.out_dir, f"pid{rank}")
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank} never started")
            time.sleep(0.01)
        with open(path) as handle:
            return int(handle.read())

    def kill(self, rank: int) -> None:
        os.kill(self.pid(rank), signal.SIGKILL)

    def join(self, timeout_s: float) -> list[Outcome]:
        deadline = time.monotonic() + timeout_s
        outcomes = []
        for rank, process in enumerate(self.processes):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # a hang: the verdict says so, the process goes
                process.kill()
                process.join(10)
                outcomes.append(Outcome(None))
                continue
            path = os.path.join(self.out_dir, f"rank{rank}.pkl")
            result = None
            if os.path.exists(path):
                with open(path, "rb") as handle:
                    result = pickle.load(handle)
            outcomes.append(Outcome(process.exitcode, result))
        shutil.rmtree(self.out_dir, ignore_errors=True)  # every rank has exited: nothing writes there
        self.rendezvous.close()
        return outcomes


def spawn(world: int, fn: Callable, *args: Any, timeout_s: float = 120.0) -> Ranks:
    return Ranks(world, fn, args, timeout_s)
