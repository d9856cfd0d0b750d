"""A preemption under the launcher: every rank saves the same update, durably, then stops.

Protocol (one watch thread per rank; the main thread only at the calls that mark progress):

1. The launcher (SIGTERM, ``--preempt-signal``, the stop file) writes the notice file in each
   start's directory of its node (``runinfo.preempt_notice_path``); it signals no worker.
2. Each rank's watch thread polls the notice file every ``POLL_S`` (a stat) and its node's
   bell (``protocol/node.py``: a file the node's one store watcher keeps); it asks the store
   for ``PREEMPT_TARGET_KEY`` only when the bell rang (and each poll once it noticed), so an
   idle job's ranks send the store nothing. Either one marks the rank as ``noticed``.
3. The main thread of a rank that noticed first, at its next call with ``next_update`` U
   (``save``, ``maybe_save``, ``heartbeat``), proposes U + 1 by compare-and-set (the first
   proposal wins), rings the bell, and waits until every rank acknowledged the target
   (bounded by ``timeout_s``). No rank can pass its call U + 1 before this rank passes it (every
   training step needs every rank), so every rank knows the target before reaching it.
4. A watch thread that reads the target acknowledges it (``PREEMPT_ACK_KEY``) and ends.
5. :meth:`PreemptionWatch.due` is True from the call whose ``next_update`` reaches the
   target on: the manager saves that update whatever the cadence says and waits for it;
   :func:`stop_preempted` (all ranks) waits until it is durable on the root and raises ``Preempted``.

With nothing pending, ``due`` reads one attribute: no system call, no collective.
"""

from __future__ import annotations

import os
import threading
import time

from .. import logs, runinfo
from ..context import Context
from ..errors import Preempted
from ..format.manifest import generation_name
from ..protocol.comm import Comm
from ..protocol.messages import PREEMPT_ACK_KEY, PREEMPT_TARGET_KEY
from .replication import ReplayChain

log = logs.get(__name__)
POLL_S = 0.02  # the notice file and the bell: a stat and a small read, no store request


class PreemptionWatch:
    def __init__(self, comm: Comm, notice_path: str | None, timeout_s: float) -> None:
        self.comm = comm
        self.notice_path = notice_path
        self.timeout_s = timeout_s
        self.noticed = False
        self.target: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if notice_path is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="dist-ckpt-preempt")
            self._thread.start()

    def due(self, next_update: int) -> bool:
        """Main thread, at each progress call: whether this call must save and stop."""
        if not self.noticed:
            return False
        if self.target is None:
            self._propose(next_update + 1)
        assert self.target is not None
        return next_update >= self.target

    def _propose(self, target: int) -> None:
        agreed = self.comm.store.compare_set(PREEMPT_TARGET_KEY, "", str(target))
        self.comm.node.ring()  # ranks of other nodes may have no notice: they learn it here
        self.target = int(agreed)
        log.warning("preemption notice: every rank saves update %d, then stops", self.target)
        deadline = time.monotonic() + self.timeout_s
        while self.comm.store.add(PREEMPT_ACK_KEY, 0) < self.comm.world_size:
            if time.monotonic() >= deadline:
                log.error("not every rank acknowledged the preemption target within %.0f s",
                          self.timeout_s)
                return
            time.sleep(0.01)

    def _watch(self) -> None:
        assert self.notice_path is not None
        bell = self.comm.node.bell
        seen = -1  # the store is asked once at the start: a target set before this watch began
        while not self._stop.wait(POLL_S):
            try:
                rang = bell.value()
                if self.target is None and (self.noticed or rang != seen) \
                        and self.comm.store.check([PREEMPT_TARGET_KEY]):
                    self.target = int(self.comm.store_get(PREEMPT_TARGET_KEY))
                if self.target is not None:
                    self.noticed = True
                    self.comm.store.add(PREEMPT_ACK_KEY, 1)
                    return
                seen = rang
                if os.path.exists(self.notice_path):
                    self.noticed = True
            except Exception:  # noqa: BLE001 - the store is gone (a peer or the job ended)
                log.debug("preemption watch stopped", exc_info=True)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def stop_preempted(ctx: Context, persister: ReplayChain | None, next_update: int) -> None:
    """All ranks, once the agreed update's save committed (the manager waited for it): with the
    memory tier (``persister``), wait until it is persisted to the root (the node's memory may
    not survive), then stop with ``Preempted``."""
    name = generation_name(next_update)
    if persister is not None:
        timeout_s = ctx.config.close_timeout_s
        if ctx.comm.rank == 0 and not persister.head.drain(timeout_s):  # the root; not the mirror
            log.error("%s not persisted to the root within %s s", name, timeout_s)
        ctx.comm.barrier()  # every rank's replay stays until rank 0 published
    runinfo.report(ctx.comm.rank, preempted=name, preempted_update=next_update)
    raise Preempted(name, next_update)
