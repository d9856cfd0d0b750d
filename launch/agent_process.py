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

Call order (the launcher's main thread): ``start_agent(argv, env)`` forks when no other Python
thread runs (else it starts a fresh interpreter, as before); then ``wait``/``poll``/
``send_signal`` as on a ``subprocess.Popen``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
WAIT_STEP_S = 0.01  # how often ``wait(timeout)`` looks for the agent's exit


def die_with_parent() -> None:
    """This process gets SIGTERM when its parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def start_agent(argv: list[str], env: dict[str, str]) -> AgentProcess | subprocess.Popen:
    """The start's agent: forked while the launcher runs no other Python thread; otherwise
    (an object-store mirror's client leaves its event loop running) a fresh interpreter, as
    forking a process whose other threads may hold locks is not safe."""
    if threading.active_count() == 1:
        return AgentProcess(argv, env)
    return subprocess.Popen([sys.executable, "-m", "launch.agent", *argv], env=env,
                            start_new_session=True, preexec_fn=die_with_parent)


class AgentProcess:
    """The Popen subset the launcher uses: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``."""

    def __init__(self, argv: list[str], env: dict[str, str],
                 target: Callable[[list[str]], int] | None = None) -> None:
        """Fork; the child runs ``target(argv)`` (default ``launch.agent.main``) and exits
        with what it returns."""
        _flush()  # a buffered line must not be printed twice
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # never returns: nothing of the launcher's stack runs in the child
            try:
                _run_agent(argv, env, launcher, target)
            finally:
                os._exit(1)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # reaped by the poll this one interrupts (the launcher's signal handler ends a
                # start from inside the poll loop): that call records the real status on return
                self.returncode = -signal.SIGKILL
                return self.returncode
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
        _fresh_signal_handlers()
        _close_inherited_files()
        os.environ.clear()
        os.environ.update(env)
        if target is None:
            from .agent import main as target
        code = target(argv)
    except SystemExit as exc:  # as the interpreter ends on it
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # as an interpreter does: ended by SIGINT
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - said on stderr, as an interpreter would
        traceback.print_exc()
    finally:
        # torchrun's handlers raise: a late SIGTERM must not unwind into the launcher's frames
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        _flush()
        os._exit(code)


def _fresh_signal_handlers() -> None:
    """Every handler the launcher installed (its preemption signal may be any) back to what
    an interpreter starts with."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _close_inherited_files() -> None:
    """Every descriptor but stdin, stdout and stderr (those open, not the whole range: a
    container's descriptor limit can be in the millions)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.close(fd)
            except OSError:  # the listing's own descriptor, closed already
                pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - exiting either way
            pass
