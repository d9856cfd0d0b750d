"""Store traffic of a real multi-rank job, counted inside each rank (issue 41).

``CountingStore`` wraps the checkpoint ``Comm``'s namespaced store and counts, per rank,
the requests sent and the bytes read back (values of ``get``, ``multi_get``,
``compare_set``). ``node_size`` ranks form a node the way torchrun describes one
(``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), so one machine runs several nodes.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from . import workers


class CountingStore:
    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests = 0
        self.read = 0
        self._lock = threading.Lock()

    def _count(self, read: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.read += read

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.requests, self.read

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        self._count(len(value))
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.store.multi_get(keys)
        self._count(sum(len(v) for v in values))
        return values

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value = self.store.compare_set(key, expected, desired)
        self._count(len(value))
        return value

    def check(self, keys: list[str]) -> bool:
        self._count()
        return self.store.check(keys)

    def add(self, key: str, amount: int) -> int:
        self._count()
        return self.store.add(key, amount)

    def set(self, key: str, value: bytes) -> None:
        self._count()
        self.store.set(key, value)

    def delete_key(self, key: str) -> bool:
        self._count()
        return self.store.delete_key(key)


def save_and_idle(rank: int, world: int, root: str, node_size: int) -> dict:
    """Three saves (the first plans), then an idle window; what each rank sent and read."""
    os.environ.update(LOCAL_RANK=str(rank % node_size), LOCAL_WORLD_SIZE=str(node_size), RANK=str(rank))
    job = workers.build("ddp", rank, world)
    mgr = workers.manager(job, root)
    counting = CountingStore(mgr.comm.store)
    mgr.comm.store = counting  # type: ignore[assignment]
    mgr.comm.node.store = counting  # the node's bell watcher
    per_save = []
    for update in (1, 2, 3):
        workers.train_step(job)
        before = counting.snapshot()
        mgr.save(update)
        after = counting.snapshot()
        per_save.append((after[0] - before[0], after[1] - before[1]))
    # a measurement window, not a synchronisation: the bell watcher backs off to its idle
    # rate within about 1.3 s of the last ring, then the window counts what idle costs
    quiet = threading.Event()
    quiet.wait(1.5)
    before = counting.snapshot()
    quiet.wait(2.0)
    after = counting.snapshot()
    leader = mgr.comm.node.is_leader
    mgr.close()
    return {"per_save": per_save, "idle_requests": after[0] - before[0], "leader": leader}
