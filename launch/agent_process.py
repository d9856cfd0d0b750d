"""A start's torchrun agent as a process forked from the launcher, not a fresh interpreter.

The launcher imported torch already (torchrun's options are parsed with torchrun's own
parser), so a forked agent starts without importing it again: a restart costs the job one
torch import less per start (seconds of CPU on a busy node). The child becomes what a
fresh ``python -m launch.agent`` would have been before it runs ``launch.agent.main``:

- a session of its own (the launcher ends a start by signalling the agent's group);
- SIGTERM to it when the launcher dies (``PR_SET_PDEATHSIG``), so a launcher killed outright
  leaves no agent and no workers behind;
- the default handlers for the signals the launcher handles (torchrun installs its own);
- no file descriptor of the launcher's but stdin, stdout and stderr (the memory
  directory's lock, held for the launcher's life, must not outlive it in an agent);
- the start's environment.

It ends with ``os._exit``: none of the launcher's clean-up runs twice.

Call order (the launcher's main thread, the only thread it runs): ``AgentProcess(argv,
env)`` forks; then ``wait``/``poll``/``send_signal`` as on a ``subprocess.Popen``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
WAIT_STEP_S = 0.01  # how often ``wait(timeout)`` looks for the agent's exit
# the launcher's handlers (runner.py) and what a fresh interpreter has instead
_FRESH_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                   signal.SIGUSR1: signal.SIG_DFL, signal.SIGUSR2: signal.SIG_DFL,
                   signal.SIGHUP: signal.SIG_DFL, signal.SIGQUIT: signal.SIG_DFL}


def die_with_parent() -> None:
    """This process gets SIGTERM when its parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class AgentProcess:
    """The Popen subset the launcher uses: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``."""

    def __init__(self, argv: list[str], env: dict[str, str],
                 target: Callable[[list[str]], int] | None = None) -> None:
        """Fork; the child runs ``target(argv)`` (default ``launch.agent.main``) and exits
        with what it returns."""
        for stream in (sys.stdout, sys.stderr):  # a buffered line must not be printed twice
            stream.flush()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # never returns
            _run_agent(argv, env, launcher, target)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0.0)
            time.sleep(WAIT_STEP_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def _run_agent(argv: list[str], env: dict[str, str], launcher: int,
               target: Callable[[list[str]], int] | None) -> None:
    code = 1
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != launcher:  # the launcher died before the line above
            os._exit(1)
        for sig, handler in _FRESH_HANDLERS.items():
            signal.signal(sig, handler)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(env)
        if target is None:
            from .agent import main as target
        code = target(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - said on stderr, as an interpreter would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - exiting either way
                pass
        os._exit(code)
