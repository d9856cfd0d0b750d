"""How a start ended, in the order that decides what the launcher does next.

0. ``usage``: torchrun rejected the command line (the same on every start): exit 2, once.
1. ``done``: a DONE record holds for this run (contract digest of this start's workers, final
   generation still valid), whatever the exit codes say: a job that wrote DONE and then died
   in interpreter teardown is finished, not failed.
2. ``finished``: every worker exited 0 but nobody called ``finish()``: over, not restarted.
3. ``preempted``: the launcher gave the workers a preemption notice (SIGTERM, the
   ``--preempt-signal``, the stop file) and they saved: the generation a rank reported it saved
   for the preemption, else a generation newer than where the start resumed. A rank's report
   of a preemption save counts without a notice too: another node's launcher gave it. Exit codes say
   nothing here (torchrun SIGTERMs the other workers when the first exits with
   ``PREEMPTED_EXIT``). A preemption that saved nothing is ``stopped``.
4. ``stopped``: SIGINT to the launcher (forwarded to the workers), or a preemption without a
   new generation.
5. ``permanent``: a worker reported an error no restart can cure (bad config, contract
   mismatch, torch version refused, no space, a key that rejects every generation), or the
   preflight found the script missing or the disk too full. Stop, exit non-zero.
6. ``hung``: the launcher's watchdog ended the start: no rank made progress for the hang
   timeout (:mod:`launch.watchdog`); the reason names the suspects. Restarted like a transient
   failure.
7. ``transient``: anything else (a killed worker, OOM, a collective timeout, a lost node):
   back off, and start again from the newest validated generation, unless ``--max-no-progress``
   such starts in a row committed nothing newer than where they resumed (:class:`CrashLoop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dist_ckpt.launcher_api import WorkerReport, find_done, latest_generation, latest_update

DONE, FINISHED, PREEMPTED, STOPPED = "done", "finished", "preempted", "stopped"
PERMANENT, TRANSIENT = "permanent", "transient"
HUNG = "hung"  # transient too: not in ENDS_THE_LOOP, the loop starts again
STOPPED_EXIT = 128 + 15  # a worker that exits on the agent's SIGTERM
USAGE = "usage"  # torchrun rejected the command line: permanent, exit 2
ENDS_THE_LOOP = frozenset({DONE, FINISHED, PREEMPTED, STOPPED, PERMANENT, USAGE})


@dataclass
class Verdict:
    kind: str
    reason: str


def contract_digest(reports: dict[int, WorkerReport]) -> str | None:
    digests = {r["contract_digest"] for r in reports.values() if r.get("contract_digest")}
    return digests.pop() if len(digests) == 1 else None


def done_verdict(run_root: str, reports: dict[int, WorkerReport],
                 mirror: str | None) -> Verdict | None:
    digest = contract_digest(reports)
    if digest is None:
        return None  # no worker of this start said which run it is: no DONE can be its own
    roots = {r.get("root") for r in reports.values() if r.get("root")} or {run_root}
    mirrors = {r.get("mirror") for r in reports.values() if r.get("mirror")} or {mirror}
    record = find_done(sorted(roots), contract_digest=digest, mirror=next(iter(mirrors)))
    if record is None:
        return None
    return Verdict(DONE, f"DONE: {record.generation}, {record.tokens_seen} tokens seen")


def failure_summary(result: dict[str, Any] | None, agent_rc: int | None) -> str:
    if result is None:
        return f"the torchrun agent exited with {agent_rc} and no result"
    if result.get("error"):
        return f"torchrun failed: {result['error'].splitlines()[0][:300]}"
    if result.get("signal"):
        return f"torchrun stopped by {result['signal']}"
    parts, stopped = [], []
    for rank, failure in sorted(result.get("failures", {}).items(), key=lambda kv: int(kv[0])):
        code = failure.get("exitcode")
        signal = failure.get("signal")
        if signal == "SIGTERM" or code == STOPPED_EXIT:
            # the agent SIGTERMs the survivors of a failure: a consequence, listed last
            stopped.append(f"rank {rank} stopped by torchrun")
        elif code is not None and code < 0 and signal and not signal.startswith("<"):
            parts.append(f"rank {rank} killed by {signal}")
        else:
            last = [line for line in (failure.get("message") or "").strip().splitlines()
                    if "To enable traceback" not in line]  # torchrun's filler without an error file
            parts.append(f"rank {rank} exited {code}" + (f" ({last[-1][:160]})" if last else ""))
    parts += stopped
    return "; ".join(parts) or "failed without a reported reason"


# what a launcher user does about a permanent error, beyond what the library's message says
FIXES = {"ContractMismatch": "; or start a new run with --fresh",
         "NoValidGeneration": " (--fresh starts a new run)"}


def permanent_reason(reports: dict[int, WorkerReport]) -> str | None:
    for rank, report in sorted(reports.items()):
        failure = report.get("failure") or {}
        if failure.get("permanent"):
            first = (str(failure.get("message", "")).splitlines() or [""])[0][:4000]
            hint = FIXES.get(str(failure.get("error")), "")
            return f"rank {rank}: {failure.get('error')}: {first}{hint}"
    return None


def resumed_update(reports: dict[int, WorkerReport]) -> int | None:
    """The update this start's workers resumed at (0 for a fresh start); None unreported."""
    return next((r["next_update"] for _, r in sorted(reports.items())
                 if isinstance(r.get("next_update"), int)), None)


def preempted_verdict(run_root: str, reports: dict[int, WorkerReport]) -> Verdict:
    """After a preemption notice: what the workers saved for it (their reports), else the
    newest generation when it is newer than where the start resumed, else nothing saved."""
    saved = sorted((r["preempted_update"], r["preempted"]) for r in reports.values()
                   if r.get("preempted") and isinstance(r.get("preempted_update"), int))
    if saved:
        update, name = saved[-1]
        return Verdict(PREEMPTED, f"saved {name} at update {update}")
    newest, name, resumed = latest_update(run_root), latest_generation(run_root), resumed_update(reports)
    if newest is not None and (resumed is None or newest > resumed):
        return Verdict(PREEMPTED, f"saved {name} at update {newest} (the newest generation; no worker "
                                  f"reported its preemption save)")
    return Verdict(STOPPED, "preempted before any new generation was saved: the next start resumes "
                            f"from {name or 'nothing (fresh)'}")


def classify(*, run_root: str, reports: dict[int, WorkerReport], result: dict[str, Any] | None,
             agent_rc: int | None, stop_reason: str | None, mirror: str | None,
             hung: str | None = None, preempted: bool = False) -> Verdict:
    if result is not None and result.get("usage"):
        return Verdict(USAGE, f"torchrun rejected the command line: {result['usage']}")
    done = done_verdict(run_root, reports, mirror)
    if done is not None:
        return done
    if result is not None and result.get("ok") and agent_rc == 0:
        return Verdict(FINISHED, "every worker exited 0 without finish(): no DONE record")
    if preempted or any(r.get("preempted") for r in reports.values()):
        # a rank that saved for a preemption: on a node whose launcher got no notice too
        return preempted_verdict(run_root, reports)
    if stop_reason is not None:
        return Verdict(STOPPED, stop_reason)
    permanent = permanent_reason(reports)
    if permanent is not None:
        return Verdict(PERMANENT, permanent)
    if hung is not None:
        return Verdict(HUNG, hung)
    return Verdict(TRANSIENT, failure_summary(result, agent_rc))


class CrashLoop:
    """Counts the failed starts in a row that committed nothing newer than the update they
    resumed from (the same update for all: a start that resumed further on begins a new
    count). Call :meth:`failed` after each start that the loop restarts."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: never a crash loop
        self.update: int | None = None
        self.count = 0

    def failed(self, resumed: int | None, newest: int | None) -> str | None:
        """``resumed``: the update the start resumed from (None: unknown, then the newest
        update before it); ``newest``: the newest committed update after it. Returns the
        outcome once ``limit`` starts in a row made no progress, else None."""
        start = resumed if resumed is not None else 0
        if newest is not None and newest > start:
            self.update, self.count = None, 0
            return None
        if start != self.update:
            self.update, self.count = start, 0
        self.count += 1
        if self.limit and self.count >= self.limit:
            return f"crash loop at update {start}"
        return None
