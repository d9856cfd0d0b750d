"""The saves in flight on one rank and the failures not raised yet.

Call order (every rank, main thread, inside ``CheckpointManager``): ``add`` when a save
starts; ``reap`` before each save agreement and in ``wait`` (finished jobs leave the list,
their store keys are retired, a failure is kept until raised); ``raise_agreed`` with the
failed generations every rank agreed on (the save agreement carries each rank's
``unraised``), so all ranks raise the same ``CommitError`` once; ``wait`` / ``join`` drain.
The save threads only set ``SaveJob.done``; nothing else here is touched off the main thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import CommitError
from ..protocol.comm import Comm
from .coordinator import StoreKeyRetirer
from .request import SaveJob


@dataclass
class SaveStats:
    requested: int = 0
    started: int = 0
    skipped: int = 0
    committed: int = 0
    failed: int = 0
    last_blocking_s: float = 0.0


class InFlight:
    def __init__(self, comm: Comm) -> None:
        self.jobs: list[SaveJob] = []
        self.stats = SaveStats()
        self._retirer = StoreKeyRetirer(comm)
        self._unraised: dict[str, CommitError] = {}
        self._raised: set[str] = set()

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job: SaveJob) -> None:
        self.stats.started += 1
        self.jobs.append(job)

    def unraised(self) -> tuple[str, ...]:
        """Failed generations this rank has not raised yet (one of the save agreement's facts)."""
        return tuple(sorted(self._unraised))

    def unwritten(self) -> int:
        """Saves whose files are not on the disk yet: they still take their share of space."""
        return sum(1 for job in self.jobs if not job.written)

    def wait_oldest(self) -> None:
        if self.jobs:
            self.jobs[0].done.wait()

    def reap(self) -> None:
        for job in [j for j in self.jobs if j.done.is_set()]:
            self.jobs.remove(job)
            if job.thread is not None:
                # done is set as the thread's last step: a daemon thread still unwinding when
                # the interpreter finalises would be killed inside native code
                job.thread.join(timeout=10)
            self._retirer.retire(job)
            if job.committed:
                self.stats.committed += 1
            else:
                self.stats.failed += 1
                gen = job.request.generation
                if job.error is not None and gen not in self._raised:
                    self._unraised[gen] = job.error

    def raise_agreed(self, generations: list[str]) -> None:
        """Raise one ``CommitError`` for ``generations`` (every rank passes the same list),
        with the per-rank failures this rank knows of; nothing when the list is empty."""
        if not generations:
            return
        failures: dict[int, str] = {}
        for gen in generations:
            known = self._unraised.pop(gen, None)
            if known is not None:
                failures.update(known.failures)
            self._raised.add(gen)
        raise CommitError(f"generation(s) {', '.join(generations)} failed to commit",
                          generation=generations[-1], failures=failures)

    def raise_unraised(self) -> None:
        self.raise_agreed(sorted(self._unraised))

    def wait(self, timeout_s: float | None = None) -> None:
        """Drain every save in flight; raise failures not yet raised (once)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for job in list(self.jobs):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(remaining):
                raise CommitError(f"{job.request.generation} still in flight after {timeout_s} s",
                                  generation=job.request.generation)
        self.reap()
        self.raise_unraised()

    def join(self, deadline: float) -> list[str]:
        """After a failed or timed-out ``wait``: join the save threads until ``deadline`` and
        reap them; returns the generations still running (daemon threads, killed at exit)."""
        for job in list(self.jobs):
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
        self.reap()
        return [job.request.generation for job in self.jobs]
