"""The restart loop: bounded starts, backoff, operator stop, free-space preflight.

Call order (one launcher process per node, main thread): ``Launcher(options).run()``. Each
start runs ``python -m launch.agent`` (torch's elastic launcher) in its own session, waits for
it while watching the stop file, classifies the outcome (:mod:`launch.policy`), logs one line
and one JSON record, then stops or backs off and starts again. SIGTERM/SIGINT to the launcher
are forwarded once to the agent, which forwards them to the workers; no further start follows.
While a start runs, every poll reads the ranks' progress marks: the watchdog
(:mod:`launch.watchdog`) ends a start that no rank advances (outcome ``hung``, restarted) and
names the stragglers.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from dist_ckpt import launcher_api as api

from . import memory_dir, policy, records, watchdog
from .options import LaunchOptions
from .rundir import choose_run

POLL_S = 0.2
END_GRACE_S = 10.0  # between the SIGTERM that ends a hung start and the SIGKILL
EXIT_OK, EXIT_PERMANENT, EXIT_GAVE_UP, EXIT_STOPPED = 0, 1, 3, 4
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # a launcher killed outright must not leave a torchrun agent and its workers behind
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


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
        self._agent: subprocess.Popen | None = None
        self._signal: int | None = None
        self._wake = threading.Event()
        self.watchdog = watchdog.Watchdog(options.hang_timeout, options.startup_timeout)
        self.stragglers = watchdog.Stragglers(options.straggler_factor, options.straggler_window,
                                              socket.gethostname())
        self._hung: str | None = None

    @property
    def mirror(self) -> str | None:
        return api.mirror_run_url(self.options.mirror, self.run_id) if self.options.mirror else None

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> int:
        for note in self.options.notes:
            records.emit(f"[launch] {note}")
        records.emit(f"[launch] run {self.run_id} ({'new' if self.created else 'continued'}) in "
                     f"{self.run_dir}; stop file {self.options.stop_file}")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        memory = self._claim_memory()
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if memory is not None and memory_dir.remove_run(self.run_id):
                records.emit(f"[launch] removed in-memory checkpoints {memory}")

    def _claim_memory(self) -> str | None:
        """The node's shared memory for the memory tier (:mod:`launch.memory_dir`): first remove what
        dead launchers left (this run's own directory too: its launcher is gone, so are the
        bytes' guarantees), then own this run's directory until the launcher stops."""
        for stale in memory_dir.remove_stale():
            records.emit(f"[launch] removed stale in-memory checkpoints {stale}")
        if not api.can_name_memory_dir(self.run_id):
            records.emit(f"[launch] run id {self.run_id!r} cannot name a shared-memory directory: "
                         "no memory tier for this run")
            return None
        try:
            return memory_dir.claim(self.run_id)
        except OSError as exc:
            records.emit(f"[launch] cannot create the in-memory checkpoint directory: {exc}")
            return None

    def _loop(self) -> int:
        opts = self.options
        for start in range(1, opts.max_starts + 1):
            backoff = opts.backoff_before(start)
            if self._stop_reason() is None and backoff:
                records.emit(f"[launch] waiting {backoff:g} s before start {start}")
                self._sleep(backoff)
            stop = self._stop_reason()
            if stop is not None:
                return self._finish(f"stopped before start {start}: {stop}", EXIT_STOPPED)
            record = self._start(start, backoff)
            self.records.append(record)
            records.emit(record.line())
            records.append(self.root, record)
            if record.classification in policy.ENDS_THE_LOOP:
                code = {policy.DONE: EXIT_OK, policy.FINISHED: EXIT_OK,
                        policy.STOPPED: EXIT_STOPPED}.get(record.classification, EXIT_PERMANENT)
                return self._finish(f"{record.classification}: {record.reason}", code)
        return self._finish(f"gave up after {opts.max_starts} starts without DONE", EXIT_GAVE_UP)

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
        problem = self._preflight()
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
        result = api.read_report(result_path)
        reports = api.read_reports(start_dir)
        verdict = policy.classify(run_root=self.run_dir, reports=reports, result=result,
                                  agent_rc=agent_rc, stop_reason=stop, mirror=self.mirror,
                                  hung=self._hung)
        record.classification, record.reason = verdict.kind, verdict.reason
        record.ranks = self.stragglers.figures()
        self._describe(record, reports, result)
        if api.can_name_memory_dir(self.run_id):
            record.memory_bytes = memory_dir.used_bytes(self.run_id)
        return record

    def _run_agent(self, start_dir: str, result_path: str) -> tuple[int | None, str | None]:
        env = dict(os.environ)
        env.update({api.ROOT_ENV: self.run_dir, api.RUN_ID_ENV: self.run_id,
                    api.LAUNCH_DIR_ENV: start_dir})
        if self.mirror:
            env[api.MIRROR_ENV] = self.mirror
        command = [sys.executable, "-m", "launch.agent", result_path, *self.options.torchrun_argv]
        self._agent = subprocess.Popen(command, env=env, start_new_session=True,
                                       preexec_fn=_die_with_parent)
        stop: str | None = None
        self._hung = None
        self.watchdog.begin(time.monotonic())
        self.stragglers.begin()
        try:
            while True:
                try:
                    return self._agent.wait(timeout=POLL_S), stop
                except subprocess.TimeoutExpired:
                    pass
                if stop is None:
                    marks = api.read_marks(start_dir)
                    for line in self.stragglers.observe(marks):
                        records.emit(line)
                    hung = self.watchdog.observe(marks, time.monotonic())
                    if hung is not None:
                        self._hung = hung.reason
                        records.emit(f"[launch] hung: {hung.reason}: ending the start")
                        return self._end_start(self._agent, marks), stop
                reason = self._stop_reason()
                if reason is not None and stop is None:
                    stop = reason
                    forwarded = signal.Signals(self._signal or signal.SIGTERM)
                    records.emit(f"[launch] {reason}: sending {forwarded.name} to the workers")
                    self._agent.send_signal(forwarded)  # torchrun forwards it to every worker
        finally:
            self._agent = None

    def _end_start(self, agent: subprocess.Popen, marks: dict[int, api.Mark]) -> int | None:
        """End a hung start: SIGTERM then SIGCONT (a stopped worker must get to handle the
        SIGTERM) to the agent's process group and to each worker's (torchrun starts every
        worker in a session of its own), then after END_GRACE_S SIGKILL to all of them, which
        also ends a stopped or uninterruptible worker. Returns the agent's exit status."""
        groups = [agent.pid, *sorted(_children(agent.pid) | {m.pid for m in marks.values() if m.pid > 0})]
        for sig in (signal.SIGTERM, signal.SIGCONT):
            for group in groups:
                _signal_group(group, sig)
        deadline = time.monotonic() + END_GRACE_S
        while time.monotonic() < deadline and not (agent.poll() is not None and
                                                   not any(_alive(pid) for pid in groups[1:])):
            time.sleep(POLL_S)
        for group in groups:
            _signal_group(group, signal.SIGKILL)
        return agent.wait()

    def _describe(self, record: records.StartRecord, reports: dict[int, api.WorkerReport],
                  result: dict[str, Any] | None) -> None:
        sizes = {r["world_size"] for r in reports.values() if isinstance(r.get("world_size"), int)}
        record.world_size = sizes.pop() if len(sizes) == 1 else None
        resumed = [r for _, r in sorted(reports.items()) if "resumed_from" in r]
        if resumed:
            record.resumed_from = resumed[0]["resumed_from"] or "fresh"
            record.resumed_update = resumed[0].get("next_update")
            record.resumed_tier = resumed[0].get("resumed_tier")
        record.final_update = api.latest_update(self.run_dir)
        if record.final_update is not None and record.resumed_update is not None:
            record.updates = max(0, record.final_update - record.resumed_update)
        if result is not None:
            record.exit_codes = {rank: f.get("exitcode") for rank, f in result.get("failures", {}).items()}

    # ---- preflight and stopping ---------------------------------------------------------
    def _preflight(self) -> str | None:
        args = self.options.torchrun
        script = args.training_script
        if args.no_python:
            if shutil.which(script) is None and not os.path.isfile(script):
                return f"program not found: {script}"
        elif not args.module and not os.path.isfile(script):
            return f"training script not found: {script}"
        need = self.options.min_free_bytes
        if need is None:
            need = api.newest_generation_bytes(self.run_dir) or 0
        try:
            free = api.free_bytes(self.run_dir)
        except OSError as exc:
            records.emit(f"[launch] cannot measure free space under {self.run_dir}: {exc}")
            return None
        if free < need:
            return (f"insufficient space: {free} bytes free under {self.run_dir}, a start needs "
                    f"{need} (one more generation, or --min-free-bytes)")
        return None

    def _stop_reason(self) -> str | None:
        if self._signal is not None:
            return f"{signal.Signals(self._signal).name} received"
        if os.path.exists(self.options.stop_file):
            return f"stop file {self.options.stop_file} exists (remove it to start again)"
        return None

    def _on_signal(self, signum: int, _frame: object) -> None:
        # only a flag: the loop forwards it once, within POLL_S, from the main thread
        if self._signal is None:
            self._signal = signum
        self._wake.set()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._stop_reason() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(min(POLL_S, remaining))

