"""The launcher's side of a preemption: a notice to the workers, a grace period, then a kill.

SIGTERM to the launcher, the ``--preempt-signal`` or the operator's stop file asks for a
preemption. No signal goes to the workers: the launcher writes the notice file
(``PREEMPT_NOTICE_NAME``) into the running start's directory; every rank sees it, all agree on
one update, save it durably and exit with ``PREEMPTED_EXIT`` (``dist_ckpt.lifecycle.preemption``
is the workers' half). The launcher waits up to ``--grace`` seconds, then ends the start. A
second SIGTERM (or preempt signal) during a preemption ends it at once.

Call order (the launcher's main thread; the signal handler calls only :meth:`requested`):
:meth:`requested` whenever asked; :meth:`step` at each poll of a running start (writes the
notice, or says the start must end); :meth:`over` when that start has ended, then
:meth:`seconds`.
"""

from __future__ import annotations

import os
import time
from enum import Enum

from dist_ckpt.launcher_api import PREEMPT_NOTICE_NAME, atomic_write


class Step(Enum):
    WAIT = "wait"  # nothing to do, or the workers are saving within the grace
    NOTIFIED = "notified"  # the notice was written at this step
    END = "end"  # the grace ran out, or a second request: end the start now


class Preemption:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.reason: str | None = None  # what asked first; None: no preemption
        self.requests = 0  # signals: a second one ends the start at once
        self.noticed_s: float | None = None  # monotonic time of the notice to the running start
        self.ended_why: str | None = None  # why the start was ended, once it was
        self.over_s: float | None = None  # monotonic time the start ended, after a notice

    @property
    def pending(self) -> bool:
        return self.reason is not None

    @property
    def noticed(self) -> bool:
        return self.noticed_s is not None

    def requested(self, reason: str, *, signal: bool) -> None:
        """A preemption is asked for (a signal: counted; the stop file: once)."""
        if self.reason is None:
            self.reason = reason
        if signal:
            self.requests += 1

    def step(self, start_dir: str) -> Step:
        if self.reason is None or self.ended_why is not None:
            return Step.WAIT
        if self.noticed_s is None:
            atomic_write(os.path.join(start_dir, PREEMPT_NOTICE_NAME), self.reason.encode())
            self.noticed_s = time.monotonic()
            return Step.NOTIFIED
        if self.requests >= 2:
            self.ended_why = "a second preemption request"
        elif time.monotonic() - self.noticed_s > self.grace_s:
            self.ended_why = f"the grace of {self.grace_s:g} s ran out"
        return Step.WAIT if self.ended_why is None else Step.END

    def over(self) -> None:
        """The start that got the notice has ended."""
        if self.noticed_s is not None and self.over_s is None:
            self.over_s = time.monotonic()

    def seconds(self) -> float:
        """From the notice to the end of the start."""
        if self.noticed_s is None:
            return 0.0
        return (self.over_s if self.over_s is not None else time.monotonic()) - self.noticed_s
