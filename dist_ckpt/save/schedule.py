"""When ``CheckpointManager.maybe_save`` saves: a fixed interval, or T* from measured costs.

Every rank must take the same decision at the same update, or the save's collective would
hang. Decisions therefore depend only on ``next_update`` and on an interval that all ranks
agree on: the fixed ``save_every`` (saves at its multiples, so that ``keep_every`` milestones
line up across restarts), or, with ``cadence="auto"``, rank 0's
``T* = sqrt(2 C M)`` converted to updates, broadcast on the checkpoint group right after each
save (all ranks are inside ``maybe_save`` then). C is the median training time lost per save
in this run (the blocking part of ``save()``), the step time the median wall time between
consecutive ``maybe_save`` calls, M the configured ``mtbf_s``.
"""

from __future__ import annotations

import statistics
import time

from . import cadence


class SaveSchedule:
    """Call order (all ranks): ``due(next_update)`` once per update; after a save that ran,
    ``saved(next_update, blocking_s, agree)`` where ``agree`` broadcasts rank 0's value."""

    def __init__(self, *, every: int, auto: bool, mtbf_s: float, history: int = 32) -> None:
        self.interval = every
        self.auto = auto
        self.mtbf_s = mtbf_s
        self.last_saved: int | None = None
        self._history = history
        self._save_costs: list[float] = []
        self._step_times: list[float] = []
        self._last_call: tuple[int, float] | None = None

    def due(self, next_update: int) -> bool:
        now = time.monotonic()
        if self._last_call is not None and next_update > self._last_call[0]:
            per_update = (now - self._last_call[1]) / (next_update - self._last_call[0])
            self._step_times = (self._step_times + [per_update])[-self._history:]
        self._last_call = (next_update, now)
        if not self.auto or self.last_saved is None:
            # a fixed cadence saves at multiples, so milestones (keep_every) line up after restarts
            return next_update % self.interval == 0
        return next_update - self.last_saved >= self.interval

    def saved(self, next_update: int, blocking_s: float, agree) -> None:
        self.last_saved = next_update
        # the save's own time is not a training step
        self._last_call = (next_update, time.monotonic())
        if not self.auto:
            return
        self._save_costs = (self._save_costs + [blocking_s])[-self._history:]
        self.interval = int(agree(self.proposed_interval()))

    def proposed_interval(self) -> int:
        if not self._save_costs or not self._step_times:
            return self.interval
        save_cost = max(statistics.median(self._save_costs), 1e-6)
        step_time = max(statistics.median(self._step_times), 1e-9)
        return cadence.interval_updates(cadence.t_star(save_cost, self.mtbf_s), step_time)
