"""One start of the job: torch's elastic launcher (``torch.distributed.run``), in its own process.

The launcher runs ``main([RESULT.json, *TORCHRUN_ARGS])`` in a process it forked for the start
(:mod:`launch.agent_process`); ``python -m launch.agent RESULT.json TORCHRUN_ARGS...`` does the
same from a fresh interpreter. It runs torchrun in-process so that the per-rank failures (exit
code, signal, error message) come back as data, and writes them to RESULT.json (atomic replace)
before exiting. A separate
process per start gives every start a fresh rendezvous and a fresh c10d store.

With torchrun's ``--run-path`` the workers are not fresh interpreters: torchrun starts each with
``multiprocessing`` (``--start-method``: ``fork`` from this process, which has torch imported,
or a ``forkserver`` that preloads torch and dist_ckpt) and runs the script in it with ``runpy``.
Each such worker first makes itself the leader of a session of its own, as torchrun's
interpreter workers are (``start_new_session``), so that the launcher's end of a start (a
signal to each worker's process group) reaches the worker and everything it started.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from dist_ckpt import launcher_api as api
from dist_ckpt.launcher_api import atomic_write

MESSAGE_LIMIT = 4000
TORCHRUN_LOGS = "torchrun-logs"
TORCHRUN_PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
CLOSED_RETRY_S = 60.0  # how long a start joins again a rendezvous still closed
CLOSED_PAUSE_S = 1.0
# what a --run-path worker started by fork or forkserver finds imported: a training script's
# own imports, mostly (torch._dynamo: what an optimizer's first construction imports), loaded
# once per start instead of once per worker
WORKER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
                  "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "dist_ckpt"]
_RUN_SCRIPT_PATH = torchrun.run_script_path


def script_in_own_session(training_script: str, *script_args: str) -> None:
    """torchrun's ``--run-path`` entry point, run by each worker: a session of its own, then
    the script as ``__main__``. Module-level, so that ``spawn`` and ``forkserver`` can pickle it."""
    os.setsid()
    _RUN_SCRIPT_PATH(training_script, *script_args)


@contextlib.contextmanager
def _run_path_workers(args: Any) -> Iterator[None]:
    """While torchrun runs: its ``--run-path`` entry point replaced by
    :func:`script_in_own_session` (``run`` takes it from its module when it builds the
    launch), and ``WORKER_PRELOAD`` imported where the workers start from."""
    if not args.run_path:
        yield
        return
    if args.start_method == "forkserver":
        multiprocessing.set_forkserver_preload(WORKER_PRELOAD)
    elif args.start_method == "fork":  # the workers are forked from this process
        for name in WORKER_PRELOAD:
            importlib.import_module(name)
    torchrun.run_script_path = script_in_own_session
    try:
        yield
    finally:
        torchrun.run_script_path = _RUN_SCRIPT_PATH


def _failures(exc: ChildFailedError) -> dict[str, dict[str, Any]]:
    out = {}
    for rank, failure in exc.failures.items():
        message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
        out[str(rank)] = {"exitcode": failure.exitcode, "signal": failure.signal_name(),
                          "local_rank": failure.local_rank, "message": message[-MESSAGE_LIMIT:]}
    return out


def _parse(torchrun_argv: list[str], result: dict[str, Any]) -> Any:
    """torchrun's arguments, or None with ``result["usage"]`` set to torchrun's complaint (its
    usage text goes to stderr once, as torchrun prints it)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return torchrun.parse_args(torchrun_argv)
    except SystemExit as exc:
        text = captured.getvalue()
        sys.stderr.write(text)
        lines = [line for line in text.splitlines() if line.strip()]
        result["usage"] = (lines[-1] if lines else f"torchrun exited {exc.code}")[-MESSAGE_LIMIT:]
        return None


def run(args: Any) -> None:
    """torchrun's ``run``, with ``--run-path`` workers as the module docstring says."""
    with _run_path_workers(args):
        torchrun.run(args)


class ExpectedExits(logging.Filter):
    """torchrun logs every worker exit but 0 as ``failed (exitcode: N)``; for a worker that
    saved its preemption generation and exited ``PREEMPTED_EXIT`` as the launcher asked, the
    line says that this exit is the expected one (torch prints it; the launcher cannot
    silence it without hiding real failures)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str) and record.msg.startswith("failed (exitcode: %s)")
                and isinstance(record.args, tuple) and record.args and record.args[0] == api.PREEMPTED_EXIT):
            record.msg += (f" [expected: exit {api.PREEMPTED_EXIT} is a worker's preemption exit "
                           "after its save]")
        return True


def expect_preemption_exits() -> None:
    """Once per agent, before torchrun runs."""
    logging.getLogger(TORCHRUN_PROCS_LOGGER).addFilter(ExpectedExits())


def keep_logs_in_start(args: Any, start_dir: str) -> None:
    """torchrun's log directory, unless the job chose one: inside this start's directory,
    not a new ``/tmp/torchelastic_*`` left behind by every start."""
    if args.log_dir is None and start_dir:
        args.log_dir = os.path.join(start_dir, TORCHRUN_LOGS)


def _run_once_open(args: Any) -> None:
    """torchrun's ``run``; joined again while the rendezvous it finds is the previous start's,
    still closing (another node's agent ends that round after its workers failed: a start
    quicker than that must not cost the job one of its bounded starts). Only before any
    worker of this start trained, and for at most ``CLOSED_RETRY_S``."""
    deadline = time.monotonic() + CLOSED_RETRY_S
    start_dir = os.environ.get(api.LAUNCH_DIR_ENV, "")
    while True:
        try:
            run(args)
            return
        except RendezvousClosedError:
            if time.monotonic() >= deadline or (start_dir and api.read_marks(start_dir)):
                raise
        print(f"[launch] the rendezvous is the previous start's, still closing: joining again in "
              f"{CLOSED_PAUSE_S:g} s", file=sys.stderr, flush=True)
        time.sleep(CLOSED_PAUSE_S)


def main(argv: list[str]) -> int:
    result_path, torchrun_argv = argv[0], argv[1:]
    result: dict[str, Any] = {"ok": False, "failures": {}, "signal": None, "error": None}
    try:
        args = _parse(torchrun_argv, result)
        if args is None:  # a usage error: the same on every start, so the launcher stops
            atomic_write(result_path, json.dumps(result).encode())
            return 2
        keep_logs_in_start(args, os.environ.get(api.LAUNCH_DIR_ENV, ""))
        expect_preemption_exits()
        _run_once_open(args)
        result["ok"] = True
    except ChildFailedError as exc:
        result["failures"] = _failures(exc)
    except SignalException as exc:
        result["signal"] = exc.sigval.name
    except Exception as exc:  # noqa: BLE001 - rendezvous timeouts and the like: a failed start
        result["error"] = f"{type(exc).__name__}: {exc}"[-MESSAGE_LIMIT:]
    atomic_write(result_path, json.dumps(result).encode())
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
