"""How a start ended, in the order that decides what the launcher does next.

1. ``done``: a DONE record holds for this run (contract digest of this start's workers, final
   generation still valid), whatever the exit codes say: a job that wrote DONE and then died
   in interpreter teardown is finished, not failed.
2. ``finished``: every worker exited 0 but nobody called ``finish()``: over, not restarted.
3. ``stopped``: the operator asked (stop file, SIGTERM/SIGINT to the launcher).
4. ``permanent``: a worker reported an error no restart can cure (bad config, contract
   mismatch, torch version refused, no space, a key that rejects every generation), or the
   preflight found the script missing or the disk too full. Stop, exit non-zero.
5. ``hung``: the launcher's watchdog ended the start: no rank made progress for the hang
   timeout (:mod:`launch.watchdog`); the reason names the suspects. Restarted like a transient
   failure.
6. ``transient``: anything else (a killed worker, OOM, a collective timeout, a lost node):
   back off, and start again from the newest validated generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dist_ckpt.launcher_api import WorkerReport, find_done

DONE, FINISHED, STOPPED, PERMANENT, TRANSIENT = "done", "finished", "stopped", "permanent", "transient"
HUNG = "hung"  # transient too: not in ENDS_THE_LOOP, the loop starts again
STOPPED_EXIT = 128 + 15  # a worker that exits on the agent's SIGTERM
ENDS_THE_LOOP = frozenset({DONE, FINISHED, STOPPED, PERMANENT})


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


def permanent_reason(reports: dict[int, WorkerReport]) -> str | None:
    for rank, report in sorted(reports.items()):
        failure = report.get("failure") or {}
        if failure.get("permanent"):
            first = str(failure.get("message", "")).splitlines()[0][:300]
            return f"rank {rank}: {failure.get('error')}: {first}"
    return None


def classify(*, run_root: str, reports: dict[int, WorkerReport], result: dict[str, Any] | None,
             agent_rc: int | None, stop_reason: str | None, mirror: str | None,
             hung: str | None = None) -> Verdict:
    done = done_verdict(run_root, reports, mirror)
    if done is not None:
        return done
    if result is not None and result.get("ok") and agent_rc == 0:
        return Verdict(FINISHED, "every worker exited 0 without finish(): no DONE record")
    if stop_reason is not None:
        return Verdict(STOPPED, stop_reason)
    permanent = permanent_reason(reports)
    if permanent is not None:
        return Verdict(PERMANENT, permanent)
    if hung is not None:
        return Verdict(HUNG, hung)
    return Verdict(TRANSIENT, failure_summary(result, agent_rc))
