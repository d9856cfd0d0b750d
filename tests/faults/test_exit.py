"""A job that ends normally, with saves still in flight at interpreter exit, exits 0 every
time (no abort in native code during finalisation): 20 runs.

One interpreter imports torch and ``dist_ckpt`` once, then forks each run; a run's process
executes the job and leaves through ``sys.exit`` at the top of its own stack, so it goes
through the interpreter's full finalisation (atexit handlers, module teardown, native
threads' exit) exactly as a job's script that reaches its end does. Only the imports are
shared, which are not what this test is about; they cost each fresh interpreter seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.matrix import record, timed

pytestmark = [pytest.mark.processes, pytest.mark.long(
    reason="20 interpreter finalisations with torch loaded: each ends a process whose heap "
           "the fork shares, about a second of CPU apiece, CPU-bound, so it stretches with "
           "whatever else the machine runs (about 35 s in CI's run, 90 s beside a second suite)")]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = 20
CONCURRENT = 2  # runs alive at once: the machine's cores
RUNNER = textwrap.dedent("""
    import os, sys, threading
    import torch
    import torch._dynamo  # what an optimizer's first construction imports
    from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState

    def job(root):
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.Adam(model.parameters())
        mgr = CheckpointManager(CheckpointConfig(root=root, async_save=True, max_in_flight=2),
                                TrainState(model, optimizer))
        for update in (1, 2, 3):
            model(torch.randn(4, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            mgr.save(update)
        # no wait(), no close(): the interpreter ends with saves in flight

    # a fork copies only the calling thread: the parent must have no other
    assert threading.active_count() == 1, threading.enumerate()
    roots, concurrent = sys.argv[2:], int(sys.argv[1])
    running, codes = {}, {}
    for root in roots:
        if len(running) == concurrent:
            pid, status = os.wait()
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        pid = os.fork()
        if pid == 0:
            job(root)
            sys.exit(0)  # unwinds this process's whole stack: a normal interpreter exit
        running[pid] = root
    while running:
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    print(" ".join(str(codes[root]) for root in roots))
""")


def test_twenty_normal_exits(tmp_path) -> None:
    roots = [str(tmp_path / f"run{index}") for index in range(RUNS)]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc, seconds = timed(lambda: subprocess.run(
        [sys.executable, "-c", RUNNER, str(CONCURRENT), *roots], env=env, timeout=240,
        capture_output=True, text=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = [int(code) for code in proc.stdout.split()]
    assert codes == [0] * RUNS, proc.stderr[-3000:]
    for root in roots:  # each run did save: the interpreter ended with its saves in flight
        assert os.path.isdir(root) and os.listdir(root), root
    record("stop at interpreter exit", observed=f"{RUNS} runs, exit codes {sorted(set(codes))}",
           recover_s=round(seconds / RUNS, 3), runs=RUNS)
