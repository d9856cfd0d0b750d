"""Progress supervision of one node's ranks: hang detection and stragglers, from the marks.

Pure logic: no process, no file. The runner reads every rank's mark of the running start
(``dist_ckpt.launcher_api.read_marks``) each poll and hands them, with the launcher's
``time.monotonic()`` (the same clock as the marks on one host), to :meth:`Watchdog.observe`
and :meth:`Stragglers.observe`.

Call order (the launcher's main thread): ``begin(now)`` when a start is launched, then
``observe(marks, now)`` at every poll of that start; the same objects serve every start of
the launcher (the auto timeout learns across starts).

**Hang.** A rank's last progress is its newest mark; while it is inside a library section
(``save``, ``restore``, ``finish``) it is progressing ("now") until the section's deadline,
and from then on its last progress is that deadline: a rank stuck in a section well past its
deadline counts as hung. The start is hung when no rank made progress for the timeout:
``--hang-timeout`` seconds, or with ``auto`` 10 x the longest interval between two
consecutive marks of one rank seen in any start of this launcher, at least 60 s. Before the
start's first mark (no rank has marked yet) the timeout is ``--startup-timeout``, counted from
the start's launch, and once every rank has been seen inside ``finish`` it applies again (the
teardown after DONE: gathering final tensors, destroying process groups, interpreter exit,
which no mark covers). The suspects are the ranks furthest behind: the lowest update (a rank
that never marked is lowest of all), and among those the ones whose last progress is oldest;
a rank past its section's deadline is a suspect before any other.

**A rank stuck beside waiting peers.** The sections are collective: when some ranks wait
inside one, a rank that stopped marking holds them there, and the section's long deadline
must not hide it. So the start is also hung when a rank made no progress for the timeout while
a peer waits inside a section (a rank is not "inside" a section while its process is stopped:
``observe``'s ``stopped``, read by the runner from ``/proc``, so a rank stopped within a
section is not taken for one working there). That rank is the suspect, never the waiting one.

**Stragglers.** In a data-parallel job the ranks run in lock step: every collective waits for
the slowest rank, so the interval between two updates is the same on every rank (the job's
pace). What differs is when each rank marks an update: a rank that does more work of its own
marks later than the others, which then wait for it in the next collective. A rank's figure
is its *own time per update*: its median interval between updates (consecutive samples, each
divided by the updates between them) minus its median lead over the last rank, where the lead
is how much earlier it marks than the rank that marks last, both positions taken at the job's
pace (``mark_s - pace x update``). The lead is the time the rank waits per update, so what is
left is the time it spent on its own work; the waiting is charged to the rank that caused it.
Medians run over a sliding window of the last ``--straggler-window`` updates each rank marked.
The job's figure is the lower median of the ranks' figures (with two ranks: the faster one),
so one straggler cannot raise the reference it is compared with. A rank is a straggler while
its figure is at least ``--straggler-factor`` x the job's (within ``FACTOR_TOLERANCE``: the
figures are medians of clock differences, not exact). A rank that spends 50% more time than
the others on its own work has a ratio of 1.5, the default factor: it is named, once its
figure reached the factor at ``CONFIRM_POLLS`` polls in a row (a change of the job's pace
moves every rank's figure for a moment). A named rank is cleared once its figure falls below
``1 + 0.75 x (factor - 1)`` x the job's (1.375 at the default), so jitter around the factor
does not print a line per poll.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

AUTO = "auto"
AUTO_MIN_S = 60.0
AUTO_FACTOR = 10.0
MIN_INTERVALS = 3  # samples a rank needs before it has a figure
FACTOR_TOLERANCE = 0.01  # relative: a ratio within 1% of the factor counts as reaching it
CONFIRM_POLLS = 2  # a rank is named once it reached the factor at this many polls in a row
CLEAR_SHARE = 0.75  # a straggler is cleared below 1 + 0.75 x (factor - 1) x the job's figure


class MarkLike(Protocol):
    """What the watchdog reads of a rank's mark (``dist_ckpt.launcher_api.Mark``)."""

    @property
    def rank(self) -> int: ...
    @property
    def update(self) -> int: ...
    @property
    def mark_s(self) -> float: ...
    @property
    def longest_s(self) -> float: ...
    @property
    def section(self) -> str: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def count(self) -> int: ...


@dataclass(frozen=True)
class Hung:
    """The verdict: ``reason`` names the timeout and the suspects."""

    reason: str
    suspects: tuple[int, ...]


@dataclass(frozen=True)
class _Progress:
    rank: int
    update: int | None  # None: the rank never marked
    at_s: float  # last progress, on the marks' clock
    past_deadline_s: float  # > 0: inside a section this long past its deadline
    section: str
    stopped: bool = False  # its process is stopped (job control): no progress, in a section or not

    @property
    def waiting(self) -> bool:
        """Inside a section within its deadline, its process running."""
        return bool(self.section) and not self.stopped and self.past_deadline_s == 0


def _progress(mark: MarkLike, now: float, launched: float, stopped: bool) -> _Progress:
    update = mark.update if mark.count > 0 else None
    base = mark.mark_s if mark.count > 0 else launched
    if stopped:
        return _Progress(mark.rank, update, base, 0.0, mark.section, stopped=True)
    if mark.section:
        if now <= mark.deadline_s:
            return _Progress(mark.rank, update, now, 0.0, mark.section)
        return _Progress(mark.rank, update, max(base, mark.deadline_s), now - mark.deadline_s, mark.section)
    return _Progress(mark.rank, update, base, 0.0, "")


class Watchdog:
    """Decides, at each poll, whether the running start is hung."""

    def __init__(self, hang_timeout: float | str, startup_timeout: float, *,
                 tie_s: float = 1.0) -> None:
        if hang_timeout != AUTO and not isinstance(hang_timeout, int | float):
            raise ValueError(f"hang_timeout must be seconds or {AUTO!r}, not {hang_timeout!r}")
        self.hang_timeout = hang_timeout
        self.startup_timeout = float(startup_timeout)
        self.tie_s = tie_s  # ranks whose last progress is this close to the oldest are suspects too
        self.longest_s = 0.0  # over every start of this launcher
        self.launched = 0.0
        self._finishing: set[int] = set()  # ranks seen inside finish() in this start

    def begin(self, now: float) -> None:
        """A start was launched at ``now``."""
        self.launched = now
        self._finishing.clear()

    def timeout_s(self) -> float:
        """The hang timeout once a rank has marked: fixed, or learned (auto)."""
        if self.hang_timeout == AUTO:
            return max(AUTO_MIN_S, AUTO_FACTOR * self.longest_s)
        return float(self.hang_timeout)

    def observe(self, marks: Mapping[int, MarkLike], now: float,
                stopped: frozenset[int] = frozenset()) -> Hung | None:
        """The verdict for this poll: None while some rank progresses within the timeout.
        ``stopped``: ranks whose process is stopped (SIGSTOP, a debugger) at this poll."""
        for mark in marks.values():
            self.longest_s = max(self.longest_s, mark.longest_s)
        self._finishing.update(m.rank for m in marks.values() if m.section == "finish")
        progress = [_progress(m, now, self.launched, m.rank in stopped) for m in marks.values()]
        started = any(p.update is not None for p in progress)
        tearing_down = bool(marks) and self._finishing >= set(marks)
        timeout = self.timeout_s() if started and not tearing_down else self.startup_timeout
        if started:
            # after finish, ranks that left it exit without marking: only a stopped process
            # is known not to be exiting
            held = self._holding_waiters(progress, now, self.timeout_s(), stopped_only=tearing_down)
            if held is not None:
                return held
        last = max([self.launched, *(p.at_s for p in progress)])
        if now - last <= timeout:
            return None
        suspects = self._suspects(progress)
        if tearing_down:
            head = f"no exit {now - last:.0f} s after finish (startup timeout {timeout:g} s)"
        elif started:
            head = f"no progress for {now - last:.0f} s (hang timeout {timeout:g} s)"
        else:
            head = f"no rank marked progress within the startup timeout of {timeout:g} s"
        if suspects:
            named = "; ".join(self._describe(p, now) for p in suspects)
            head += f"; suspect{'s' if len(suspects) > 1 else ''} {named}"
        return Hung(head, tuple(p.rank for p in suspects))

    def _holding_waiters(self, progress: list[_Progress], now: float, timeout: float,
                         stopped_only: bool = False) -> Hung | None:
        """Hung when a rank made no progress for ``timeout`` while a peer waits in a section
        (``stopped_only``: only a rank whose process is stopped counts)."""
        waiters = [p for p in progress if p.waiting]
        stale = [p for p in progress if not p.waiting and p.update is not None and p.past_deadline_s == 0
                 and now - p.at_s > timeout and (p.stopped or not stopped_only)]
        if not waiters or not stale:
            return None
        section = waiters[0].section
        named = "; ".join(self._describe(p, now) for p in stale)
        return Hung(f"no progress for {now - min(p.at_s for p in stale):.0f} s (hang timeout {timeout:g} s) "
                    f"on rank(s) {', '.join(str(p.rank) for p in stale)} while rank(s) "
                    f"{', '.join(str(p.rank) for p in waiters[:8])}{' ...' if len(waiters) > 8 else ''} "
                    f"wait in {section}; suspect{'s' if len(stale) > 1 else ''} {named}",
                    tuple(p.rank for p in stale))

    def _suspects(self, progress: list[_Progress]) -> list[_Progress]:
        if not progress:
            return []
        late = [p for p in progress if p.past_deadline_s > 0]
        if late:
            return sorted(late, key=lambda p: p.rank)
        lowest = min(-1 if p.update is None else p.update for p in progress)
        behind = [p for p in progress if (-1 if p.update is None else p.update) == lowest]
        oldest = min(p.at_s for p in behind)
        return sorted((p for p in behind if p.at_s - oldest <= self.tie_s), key=lambda p: p.rank)

    @staticmethod
    def _describe(p: _Progress, now: float) -> str:
        if p.past_deadline_s > 0:
            where = f"in {p.section} {p.past_deadline_s:.0f} s past its deadline"
        elif p.update is None:
            where = "no mark yet"
        else:
            where = f"last mark {now - p.at_s:.0f} s ago"
        if p.stopped:
            where += ", its process stopped"
        update = "" if p.update is None else f"update {p.update}, "
        return f"rank {p.rank} ({update}{where})"


@dataclass(frozen=True)
class Figure:
    """One rank's figures over its window (what the start's record keeps)."""

    rank: int
    median_s_per_update: float | None
    updates_seen: int
    straggler: bool

    def record(self) -> dict[str, float | int | bool | None]:
        value = self.median_s_per_update
        return {"median_s_per_update": None if value is None else round(value, 6),
                "updates_seen": self.updates_seen, "straggler": self.straggler}


class Stragglers:
    """Per-rank own time per update over a sliding window; names the ranks that lag."""

    def __init__(self, factor: float, window: int, host: str) -> None:
        self.factor, self.window, self.host = factor, window, host
        self._samples: dict[int, deque[tuple[int, float]]] = {}
        self._leads: dict[int, deque[tuple[int, float]]] = {}
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self.named: set[int] = set()
        self._over: dict[int, int] = {}  # consecutive polls at or over the factor, by rank

    def begin(self) -> None:
        """A new start: its ranks' samples begin afresh (a restart changes everything)."""
        self._samples.clear()
        self._leads.clear()
        self._first.clear()
        self._last.clear()
        self.named.clear()
        self._over.clear()

    def observe(self, marks: Mapping[int, MarkLike]) -> list[str]:
        """Take this poll's new marks; returns one line per rank that became, or stopped
        being, a straggler."""
        fresh = False
        for rank, mark in marks.items():
            if mark.count <= 0:
                continue
            samples = self._samples.setdefault(rank, deque())
            if samples and samples[-1][0] == mark.update:
                continue
            samples.append((mark.update, mark.mark_s))
            self._first.setdefault(rank, mark.update)
            self._last[rank] = mark.update
            _trim(samples, mark.update - self.window)
            fresh = True
        if not fresh:
            return []
        pace = self._pace()
        if pace is not None and len(self._samples) > 1:
            self._record_leads(marks, pace)
        return self._changes()

    def _intervals(self, rank: int) -> list[float]:
        samples = list(self._samples.get(rank, ()))
        return [(t2 - t1) / (u2 - u1) for (u1, t1), (u2, t2) in zip(samples, samples[1:], strict=False)
                if u2 > u1]

    def _pace(self) -> float | None:
        every = [i for rank in self._samples for i in self._intervals(rank)]
        return statistics.median(every) if every else None

    def _record_leads(self, marks: Mapping[int, MarkLike], pace: float) -> None:
        latest = {rank: samples[-1] for rank, samples in self._samples.items() if rank in marks}
        offsets = {rank: t - pace * u for rank, (u, t) in latest.items()}
        last = max(offsets.values())
        for rank, offset in offsets.items():
            leads = self._leads.setdefault(rank, deque())
            update = latest[rank][0]
            leads.append((update, last - offset))
            _trim(leads, update - self.window)

    def figure(self, rank: int) -> float | None:
        """Own time per update (module docstring); None before enough samples."""
        intervals = self._intervals(rank)
        leads = [lead for _, lead in self._leads.get(rank, ())]
        if len(intervals) < MIN_INTERVALS or not leads:
            return None
        return max(0.0, statistics.median(intervals) - statistics.median(leads))

    def job_figure(self) -> float | None:
        figures = [f for f in (self.figure(rank) for rank in self._samples) if f is not None]
        if len(figures) < 2:
            return None  # one rank has nobody to be slower than
        return statistics.median_low(figures)

    def _changes(self) -> list[str]:
        job = self.job_figure()
        if job is None:
            return []
        lines = []
        for rank in sorted(self._samples):
            own = self.figure(rank)
            if own is None:
                continue
            # hysteresis: a named rank is cleared only well below the factor (no line per jitter)
            bound = self.factor if rank not in self.named else 1 + CLEAR_SHARE * (self.factor - 1)
            over = own >= bound * job * (1 - FACTOR_TOLERANCE)
            # a change of the job's pace moves every figure for a poll: naming waits for a second
            self._over[rank] = self._over.get(rank, 0) + 1 if over else 0
            slow = self._over[rank] >= CONFIRM_POLLS if rank not in self.named else over
            if slow == (rank in self.named):
                continue
            (self.named.add if slow else self.named.discard)(rank)
            figures = f"median {own:.3g} s/update, job median {job:.3g} s/update"
            lines.append(f"[launch] straggler: rank {rank} on {self.host} {figures}" if slow else
                         f"[launch] rank {rank} on {self.host} no longer a straggler: {figures}")
        return lines

    def figures(self) -> dict[str, dict[str, float | int | bool | None]]:
        """Per rank (the key is the rank as text, as in JSON): the start record's figures."""
        return {str(rank): Figure(rank, self.figure(rank),
                                  self._last[rank] - self._first[rank] + 1,
                                  rank in self.named).record()
                for rank in sorted(self._samples)}


def _trim(samples: deque[tuple[int, float]], oldest_update: int) -> None:
    # keep one sample at or before the window's start: the first interval spans into it
    while len(samples) > 2 and samples[1][0] <= oldest_update:
        samples.popleft()
