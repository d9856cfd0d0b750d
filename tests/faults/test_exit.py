"""A job that ends normally, with saves still in flight at interpreter exit, exits 0 every
time (no abort in native code during finalisation): 20 runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

from tests.helpers.matrix import record, timed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = 20
JOB = textwrap.dedent("""
    import sys
    import torch
    from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    mgr = CheckpointManager(CheckpointConfig(root=sys.argv[1], async_save=True, max_in_flight=2),
                            TrainState(model, optimizer))
    for update in (1, 2, 3):
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        mgr.save(update)
    # no wait(), no close(): the interpreter ends with saves in flight
""")


def one_run(root: str) -> int:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", JOB, root], env=env, timeout=120,
                          capture_output=True).returncode


def test_twenty_normal_exits(tmp_path) -> None:
    roots = [str(tmp_path / f"run{index}") for index in range(RUNS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        codes, seconds = timed(lambda: list(pool.map(one_run, roots)))
    assert codes == [0] * RUNS
    record("stop at interpreter exit", observed=f"{RUNS} runs, exit codes {sorted(set(codes))}",
           recover_s=round(seconds / RUNS, 3), runs=RUNS)
