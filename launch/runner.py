"""The restart loop: bounded starts, backoff, preemption, crash loops, health before a start.

Call order (one launcher process per node, main thread): ``Launcher(options).run()``. Each
start runs ``launch.agent`` (torch's elastic launcher) in a process forked from the launcher, in
its own session (:mod:`launch.agent_process`), after the
checks of :mod:`launch.health`; waits for it while watching the stop file and the signals,
classifies the outcome (:mod:`launch.policy`), logs one line and one JSON record, then stops or
backs off and starts again. SIGTERM, the ``--preempt-signal`` and the stop file preempt the job
(:mod:`launch.preemption`: the workers save, then stop); SIGINT is forwarded once to the agent,
which forwards it to the workers. No further start follows either. While a start runs, every
poll reads the ranks' progress marks: the watchdog (:mod:`launch.watchdog`) ends a start that
no rank advances (outcome ``hung``, restarted) and names the stragglers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from typing import Any

from dist_ckpt import launcher_api as api

from . import health, memory_dir, policy, records, watchdog
from .agent_process import AgentProcess, start_agent
from .options import LaunchOptions
from .preemption import Preemption, Step
from .procstate import stopped_ranks
from .rundir import choose_run

POLL_S = 0.2
KILL_GRACE_S = 10.0  # between the SIGTERM that ends a start (hung, or past the grace) and the SIGKILL
EXIT_OK, EXIT_PERMANENT, EXIT_USAGE, EXIT_GAVE_UP, EXIT_STOPPED = 0, 1, 2, 3, 4
EXIT_PREEMPTED = api.PREEMPTED_EXIT  # neither success nor failure: start the job again later


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (the agent's workers), from /proc."""
    found = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is over: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal_group(pid: int, sig: int) -> None:
    # each worker leads its own process group (its own session): the group holds its children too
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Launcher:
    def __init__(self, options: LaunchOptions) -> None:
        self.options = options
        self.root = options.checkpoint_root
        self.run_id, self.run_dir, created = choose_run(self.root, fresh=options.fresh,
                                                       run_id=options.run_id)
        self.created = created
        self.records: list[records.StartRecord] = []
        self._agent: AgentProcess | subprocess.Popen | None = None
        self._signal: int | None = None  # SIGINT: the operator's immediate stop
        self.preemption = Preemption(options.grace_s)
        self.crash_loop = policy.CrashLoop(options.max_no_progress)
        self._worker_mirror: str | None = None  # the mirror the last start's workers reported
        self._wake = threading.Event()
        self.watchdog = watchdog.Watchdog(options.hang_timeout, options.startup_timeout)
        self.stragglers = watchdog.Stragglers(options.straggler_factor, options.straggler_window,
                                              socket.gethostname())
        self._hung: str | None = None
        self._memory_tier_used = False  # a start's workers reported the memory tier on
        self._start_dir: str | None = None  # the running start's directory (its notice goes there)
        self._memory: memory_dir.Owned | None = None  # the node's memory directory, while owned

    @property
    def mirror(self) -> str | None:
        return api.mirror_run_url(self.options.mirror, self.run_id) if self.options.mirror else None

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> int:
        for note in self.options.notes:
            records.emit(f"[launch] {note}")
        records.emit(f"[launch] run {self.run_id} ({'new' if self.created else 'continued'}) in "
                     f"{self.run_dir}; stop file {self.options.stop_file}")
        done = api.find_done([self.run_dir], contract_digest=None, mirror=self.mirror)
        if done is not None:  # nothing to start: say so before spending a start on it
            return self._finish(f"run {self.run_id} is done: DONE for {done.generation} "
                                f"({done.tokens_seen} tokens seen); --fresh starts a new run", EXIT_OK)
        handled = {signal.SIGTERM, signal.SIGINT, self.options.preempt_signal}
        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled}
        self._memory = self._claim_memory()
        try:
            return self._loop()
        finally:
            try:  # under the launcher's own handlers: a signal now cannot cut the persist short
                self._leave_memory()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _claim_memory(self) -> memory_dir.Owned | None:
        """The node's shared memory for the memory tier (:mod:`launch.memory_dir`): first remove what
        dead launchers left (this job's own directory too: its launcher is gone, so are the
        bytes' guarantees), then own this job's directory until the launcher stops."""
        for stale in memory_dir.remove_stale():
            records.emit(f"[launch] removed stale in-memory checkpoints {stale}")
        if not api.can_name_memory_dir(self.run_id):
            records.emit(f"[launch] run id {self.run_id!r} cannot name a shared-memory directory: "
                         "no memory tier for this run")
            return None
        try:
            return memory_dir.claim(self.run_id, self.run_dir)
        except OSError as exc:  # OwnedElsewhere included: a live owner is never overwritten
            records.emit(f"[launch] cannot own the in-memory checkpoint directory: {exc}; no "
                         "memory tier for this run")
            return None

    def _leave_memory(self) -> None:
        """Persist at breakpoint, then remove the memory directory: a committed in-memory
        generation newer than the root's goes to the root first (``api.persist_memory``)."""
        if self._memory is None:
            return
        directory = self._memory.path
        try:
            persisted = api.persist_memory(directory, self.run_dir, nodes=_max_nodes(
                self.options.torchrun.nnodes))
        except Exception as exc:  # noqa: BLE001 - the directory is removed all the same; say why
            persisted = api.Persisted(None, f"persisting from memory failed: {exc}")
        removed = self._memory.remove()
        self._memory = None
        line = exit_line(persisted, directory, removed=removed, used=self._memory_tier_used)
        if line is not None:
            records.emit(line)

    def _loop(self) -> int:
        opts = self.options
        for start in range(1, opts.max_starts + 1):
            backoff = opts.backoff_before(start)
            if self._interrupted() is None and backoff:
                records.emit(f"[launch] waiting {backoff:g} s before start {start}")
                self._sleep(backoff)
            if self.preemption.pending:
                newest = api.latest_generation(self.run_dir)
                return self._finish(f"preempted before start {start}: {self.preemption.reason}; "
                                    f"nothing was running (newest generation: {newest or 'none'})",
                                    EXIT_PREEMPTED)
            stop = self._interrupted()
            if stop is not None:
                return self._finish(f"stopped before start {start}: {stop}", EXIT_STOPPED)
            before = api.latest_update(self.run_dir)
            record = self._start(start, backoff)
            self.records.append(record)
            records.emit(record.line())
            records.append(self.root, record)
            if record.classification in policy.ENDS_THE_LOOP:
                return self._ended(record)
            resumed = record.resumed_update if record.resumed_update is not None else before
            loop = self.crash_loop.failed(resumed, record.final_update)
            if loop is not None and start < opts.max_starts:  # else: gave up after the last start
                return self._finish(f"{loop} ({opts.max_no_progress} starts in a row committed "
                                    f"nothing newer): {record.reason}", EXIT_GAVE_UP)
        return self._finish(f"gave up after {opts.max_starts} starts without DONE", EXIT_GAVE_UP)

    def _ended(self, record: records.StartRecord) -> int:
        kind = record.classification
        if kind == policy.PREEMPTED:
            took = (f"in {self.preemption.seconds():.1f} s" if self.preemption.noticed
                    else "(the notice came to another node's launcher)")
            return self._finish(f"preempted: {record.reason} {took}", EXIT_PREEMPTED)
        code = {policy.DONE: EXIT_OK, policy.FINISHED: EXIT_OK, policy.STOPPED: EXIT_STOPPED,
                policy.USAGE: EXIT_USAGE}.get(kind, EXIT_PERMANENT)
        return self._finish(f"{kind}: {record.reason}", code)

    def _finish(self, outcome: str, code: int) -> int:
        records.emit(records.summary(self.records, f"{outcome} (exit {code})"))
        return code

    # ---- one start ---------------------------------------------------------------------
    def _start(self, start: int, backoff: float) -> records.StartRecord:
        args = self.options.torchrun
        record = records.StartRecord(run_id=self.run_id, start=start,
                                     max_starts=self.options.max_starts, nodes=str(args.nnodes),
                                     procs_per_node=str(args.nproc_per_node),
                                     began_unix=time.time(), backoff_s=backoff)
        problem = health.preflight(self.options, self.run_dir, self.mirror or self._worker_mirror)
        if problem is not None:
            record.classification, record.reason = policy.PERMANENT, problem
            return record
        start_dir = os.path.join(self.run_dir, api.STARTS_DIR,
                                 f"{int(time.time())}-{uuid.uuid4().hex[:6]}-{start}")
        os.makedirs(start_dir)
        result_path = os.path.join(start_dir, "agent-result.json")
        began = time.monotonic()
        agent_rc, stop = self._run_agent(start_dir, result_path)
        record.duration_s = round(time.monotonic() - began, 3)
        self.preemption.over()
        result = api.read_report(result_path)
        reports = api.read_reports(start_dir)
        verdict = policy.classify(run_root=self.run_dir, reports=reports, result=result,
                                  agent_rc=agent_rc, stop_reason=stop, mirror=self.mirror,
                                  hung=self._hung, preempted=self.preemption.noticed)
        record.classification, record.reason = verdict.kind, verdict.reason
        record.ranks = self.stragglers.figures()
        self._describe(record, reports, result)
        return record

    def _run_agent(self, start_dir: str, result_path: str) -> tuple[int | None, str | None]:
        env = dict(os.environ)
        env.update({api.ROOT_ENV: self.run_dir, api.RUN_ID_ENV: self.run_id,
                    api.LAUNCH_DIR_ENV: start_dir,
                    # empty: this launcher owns no memory directory; a memory-tier worker says so
                    api.MEMORY_DIR_ENV: self._memory.path if self._memory is not None else ""})
        if self.mirror:
            env[api.MIRROR_ENV] = self.mirror
        self._agent = start_agent([result_path, *self.options.torchrun_argv], env)
        stop: str | None = None
        self._hung = None
        self._start_dir = start_dir
        self.watchdog.begin(time.monotonic())
        self.stragglers.begin()
        announced = False
        try:
            while True:
                try:
                    return self._agent.wait(timeout=POLL_S), stop
                except subprocess.TimeoutExpired:
                    pass
                if stop is None and not self.preemption.noticed:
                    marks = api.read_marks(start_dir)
                    if not announced and marks and all(m.count for m in marks.values()):
                        announced = True  # every rank of this node trains: who is who
                        records.emit("[launch] training: " + ", ".join(
                            f"rank {rank} pid {m.pid}" for rank, m in sorted(marks.items())))
                    for line in self.stragglers.observe(marks):
                        records.emit(line)
                    hung = self.watchdog.observe(marks, time.monotonic(), stopped_ranks(marks))
                    if hung is not None:
                        self._hung = hung.reason
                        records.emit(f"[launch] hung: {hung.reason}: ending the start")
                        return end_start(self._agent, {m.pid for m in marks.values()}), stop
                reason = self._interrupted()
                if self._signal is not None and stop is None:
                    stop = reason
                    records.emit(f"[launch] {reason}: sending SIGINT to the workers")
                    self._agent.send_signal(signal.SIGINT)  # torchrun forwards it to every worker
                self._preempt(start_dir)
        finally:
            self._agent = None
            self._start_dir = None

    def _preempt(self, start_dir: str) -> None:
        step = self.preemption.step(start_dir)
        if step is Step.NOTIFIED:
            records.emit(f"[launch] {self.preemption.reason}: preemption notice to the workers (they "
                         f"save, then stop); killing them in {self.preemption.grace_s:g} s")
        elif step is Step.END and self._agent is not None:
            records.emit(f"[launch] preemption: {self.preemption.ended_why}; ending the workers now")
            end_start(self._agent)

    def _describe(self, record: records.StartRecord, reports: dict[int, api.WorkerReport],
                  result: dict[str, Any] | None) -> None:
        sizes = {r["world_size"] for r in reports.values() if isinstance(r.get("world_size"), int)}
        record.world_size = sizes.pop() if len(sizes) == 1 else None
        resumed = [r for _, r in sorted(reports.items()) if "resumed_from" in r]
        if resumed:
            record.resumed_from = resumed[0]["resumed_from"] or "fresh"
            record.resumed_update = resumed[0].get("next_update")
            record.resumed_tier = resumed[0].get("resumed_tier")
            record.repaired = resumed[0].get("repaired")
        rejected = [r["rejected"] for _, r in sorted(reports.items()) if r.get("rejected")]
        record.rejected = [str(line) for line in rejected[0]] if rejected else []
        # the newest generation committed in any tier: the root's pointer, or what rank 0
        # reported (with the memory tier, memory is ahead of the root)
        committed = [api.latest_update(self.run_dir)] + [
            r.get("committed_update") for r in reports.values()]
        known = [u for u in committed if isinstance(u, int)]
        record.final_update = max(known) if known else None
        if record.final_update is not None and record.resumed_update is not None:
            record.updates = max(0, record.final_update - record.resumed_update)
        if result is not None:
            record.exit_codes = {rank: f.get("exitcode") for rank, f in result.get("failures", {}).items()}
        # memory words only for a job that uses the memory tier (the launcher claims the
        # directory for every run, used or not)
        if any(r.get("memory_tier") for r in reports.values()):
            self._memory_tier_used = True
        if self._memory_tier_used:
            record.memory_bytes = self._memory.used_bytes() if self._memory is not None else 0
        mirrors = {r.get("mirror") for r in reports.values() if r.get("mirror")}
        if len(mirrors) == 1:
            self._worker_mirror = mirrors.pop()

    # ---- stopping ----------------------------------------------------------------------
    def _interrupted(self) -> str | None:
        """Why no start may follow: SIGINT, or a preemption (a signal or the stop file)."""
        if self._signal is not None:
            return f"{signal.Signals(self._signal).name} received"
        if not self.preemption.pending and os.path.exists(self.options.stop_file):
            self.preemption.requested(f"stop file {self.options.stop_file} exists (remove it to "
                                      "start again)", signal=False)
        return self.preemption.reason

    def _on_signal(self, signum: int, _frame: object) -> None:
        # flags, and a preemption's notice at once (Python runs this handler on the main thread,
        # between two steps of the poll loop): the workers save the update after the one in
        # progress, not one a poll later; everything else is acted on within POLL_S
        if signum == signal.SIGINT and signum != self.options.preempt_signal:
            if self._signal is None:
                self._signal = signum
        else:
            self.preemption.requested(f"{signal.Signals(signum).name} received", signal=True)
            if self._start_dir is not None and not self.preemption.noticed:
                self._preempt(self._start_dir)
        self._wake.set()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._interrupted() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(min(POLL_S, remaining))


def _max_nodes(nnodes: object) -> int:
    """torchrun's ``--nnodes`` (``N`` or ``MIN:MAX``): the most nodes the job may span."""
    try:
        return max(int(part) for part in str(nnodes).split(":"))
    except ValueError:
        return 1


def exit_line(persisted: api.Persisted | None, directory: str, *, removed: bool,
              used: bool) -> str | None:
    """The launcher's last line about its memory directory; None when there is nothing to say
    (a job that never used the memory tier, and nothing persisted)."""
    if persisted is None:
        return f"[launch] removed in-memory checkpoints {directory}" if removed and used else None
    if persisted.generation is not None or not persisted.complete:
        return f"[launch] {persisted.message} before removing in-memory checkpoints {directory}"
    return f"[launch] {persisted.message}; removed in-memory checkpoints {directory}"


def end_start(agent: AgentProcess | subprocess.Popen, worker_pids: set[int] | frozenset[int] = frozenset(),
              grace_s: float = KILL_GRACE_S) -> int | None:
    """End a start now: SIGTERM then SIGCONT (a stopped worker must run to handle the SIGTERM)
    to the agent's process group and to each worker's (torchrun starts every worker in a
    session of its own: the agent's group does not reach them; ``worker_pids`` adds those the
    marks name), then, once all are gone or after ``grace_s``, SIGKILL to every group, which
    also ends a stopped or uninterruptible worker. Returns the agent's exit status."""
    groups = [agent.pid, *sorted((_children(agent.pid) | set(worker_pids)) - {0})]
    for sig in (signal.SIGTERM, signal.SIGCONT):
        for group in groups:
            _signal_group(group, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not (agent.poll() is not None and
                                               not any(_alive(pid) for pid in groups[1:])):
        time.sleep(POLL_S)
    for group in groups:
        _signal_group(group, signal.SIGKILL)
    return agent.wait()
