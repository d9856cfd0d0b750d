"""Helpers for the launcher tests: run ``python -m launch`` on the example job and read its log.

How the launched workers start (``WORKER_START_ENV``): ``fork`` (the default) passes
torchrun's ``--run-path --start-method fork``, so each worker is forked from its start's
torchrun agent, which has torch imported, and runs the script with ``runpy``: still a process
of its own, a session of its own (``launch.agent.script_in_own_session``), the environment
torchrun gives it, and the exit code or signal it ends with. ``fresh`` is the product's
default chain, a fresh interpreter per worker: the tests marked ``full_chain`` run with it
(tests/conftest.py sets it for them), and setting it for a whole run checks that a failure is
not an artefact of forking.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dist_ckpt import runinfo
from dist_ckpt.format.manifest import MANIFEST_NAME, parse_generation
from dist_ckpt.launcher_api import CURRENT_NAME, LAUNCH_LOG_NAME, RUNS_DIR, STARTS_DIR
from dist_ckpt.testing import enter_rank, held_store, join_store, rank_context, rank_environment

WORKER_START_ENV = "DIST_CKPT_TEST_WORKER_START"
# where the uninterrupted runs of one suite run are kept (scripts/test.sh shares one between its
# two sessions; tests/conftest.py makes one for a session that has none)
REFERENCES_ENV = "DIST_CKPT_TEST_REFERENCES"
WORKER_STARTS = ("fork", "fresh")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "scripts", "train_example.py")


@dataclass
class Launched:
    returncode: int
    output: str
    starts: list[dict]


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def command(root: str, *launcher_args: str, nproc: int = 2, script: str = EXAMPLE,
            script_args: tuple[str, ...] = (), nnodes: int = 1, rdzv_port: int | None = None,
            rdzv_id: str = "nodes") -> list[str]:
    """One node (``--standalone``), or one of ``nnodes`` launchers meeting in a c10d
    rendezvous on ``127.0.0.1:rdzv_port`` (each started with the same arguments)."""
    rendezvous = ["--standalone"] if nnodes == 1 else [
        "--nnodes", str(nnodes), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", rdzv_id]
    return [sys.executable, "-m", "launch", "--checkpoint-root", root, *launcher_args,
            "--nproc-per-node", str(nproc), *rendezvous, *worker_start(), os.path.abspath(script),
            *script_args]


def worker_start() -> list[str]:
    """torchrun's options for the workers' start (``WORKER_START_ENV``; module docstring)."""
    start = os.environ.get(WORKER_START_ENV, "fork")
    if start not in WORKER_STARTS:
        raise ValueError(f"{WORKER_START_ENV}={start!r}: expected one of {WORKER_STARTS}")
    return ["--run-path", "--start-method", "fork"] if start == "fork" else []


def launch(root: str, *launcher_args: str, nproc: int = 2, script: str = EXAMPLE,
           script_args: tuple[str, ...] = (), timeout: float = 240) -> Launched:
    before = len(read_log(root))
    proc = subprocess.run(command(root, *launcher_args, nproc=nproc, script=script,
                                  script_args=script_args),
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    return Launched(proc.returncode, proc.stdout + proc.stderr, read_log(root)[before:])


def _example_rank(rank: int, world: int, port: int, script_args: tuple[str, ...],
                  inherited: tuple[dict[str, str], str]) -> None:
    enter_rank(inherited)
    join_store()  # as under torchrun, whose agent holds the store its workers rendezvous in
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    sys.argv = [EXAMPLE, *script_args]
    runpy.run_path(EXAMPLE, run_name="__main__")  # ends in sys.exit(0): this rank's exit code


def reference(root: str, *script_args: str, nproc: int = 2, timeout: float = 180) -> None:
    """The uninterrupted job that a launcher test compares its restarted one with: the
    example script on ``nproc`` ranks with the environment torchrun gives them
    (``DIST_CKPT_ROOT=root``; a run id of its own for the memory tier), each rank forked from
    the fork server instead of started by torchrun's agent. Only the final state
    (``--dump-final``) is the reference: how the ranks were started is not under test here,
    and a fresh interpreter per rank costs seconds of every launcher test."""
    environment, cwd = rank_environment()
    environment = dict(environment, **env(), DIST_CKPT_ROOT=root,
                       **{runinfo.RUN_ID_ENV: f"reference-{os.getpid()}-{time.monotonic_ns()}"})
    context = rank_context()
    with held_store(timeout) as port:
        ranks = [context.Process(target=_example_rank,
                                 args=(rank, nproc, port, script_args, (environment, cwd)))
                 for rank in range(nproc)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(10)
    codes = [process.exitcode for process in ranks]
    assert codes == [0] * nproc, f"the reference run failed: exit codes {codes}"


def uninterrupted(updates: int, *, nproc: int = 2) -> dict:
    """The final state of the example job run for ``updates`` updates on ``nproc`` ranks
    without interruption: what a killed, preempted or hung job, restarted from its
    checkpoints, must end with bitwise. Computed once per suite run and read by every test
    that compares with it (``REFERENCES_ENV``; a lock file makes the first caller compute it
    while the others wait). The run saves once, at its end: checkpoints never change the
    arithmetic, which is what the tests that compare with it prove, so neither the cadence
    nor the tiers of the test's job belong in it."""
    import torch

    directory = os.environ.get(REFERENCES_ENV) or tempfile.mkdtemp(prefix="dist_ckpt-references-")
    os.environ.setdefault(REFERENCES_ENV, directory)
    key = hashlib.sha256(json.dumps([updates, nproc]).encode()).hexdigest()[:16]
    final = os.path.join(directory, f"{key}.pt")
    with open(os.path.join(directory, f"{key}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(final):
            scratch = tempfile.mkdtemp(prefix=f"{key}-", dir=directory)
            reference(os.path.join(scratch, "root"), "--updates", str(updates), "--save-every",
                      str(updates), "--dump-final", os.path.join(scratch, "final.pt"), nproc=nproc)
            os.replace(os.path.join(scratch, "final.pt"), final)
    return torch.load(final, weights_only=True)


def read_log(root: str) -> list[dict]:
    try:
        with open(os.path.join(root, LAUNCH_LOG_NAME), encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except FileNotFoundError:
        return []


def run_dir(root: str) -> str:
    with open(os.path.join(root, CURRENT_NAME), encoding="utf-8") as handle:
        return os.path.join(root, RUNS_DIR, handle.read().strip())


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll a condition on files the job writes, bounded by ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def newest_in_memory(shm_dir: str) -> int:
    """The newest committed generation number anywhere under a node's shared memory (-1: none)."""
    newest = -1
    for parent, _dirs, files in os.walk(shm_dir):
        number = parse_generation(os.path.basename(parent))
        if number is not None and MANIFEST_NAME in files:
            newest = max(newest, number)
    return newest


def worker_pids(root: str) -> dict[int, int]:
    """Rank -> pid of its newest report (every launcher of a run writes its own start
    directories; which rank landed on which node is torchrun's choice)."""
    launch_dir = os.path.join(run_dir(root), STARTS_DIR)
    pids: dict[int, int] = {}
    for start in sorted(os.listdir(launch_dir)):  # oldest first: newer reports replace older
        for name in os.listdir(os.path.join(launch_dir, start)):
            if name.startswith("rank-"):
                with open(os.path.join(launch_dir, start, name), encoding="utf-8") as handle:
                    report = json.load(handle)
                pids[int(name.removeprefix("rank-").removesuffix(".json"))] = report["pid"]
    return pids


def all_exited(pids: Iterable[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def workers_training(root: str, world_size: int) -> bool:
    """True once every rank of the current start reported where it resumed from."""
    try:
        launch_dir = os.path.join(run_dir(root), STARTS_DIR)
        starts = sorted(os.listdir(launch_dir))
    except OSError:
        return False
    if not starts:
        return False
    newest = os.path.join(launch_dir, starts[-1])
    reports = []
    for name in os.listdir(newest):
        if name.startswith("rank-"):
            with open(os.path.join(newest, name), encoding="utf-8") as handle:
                try:
                    reports.append(json.load(handle))
                except ValueError:
                    return False
    return sum("resumed_from" in r for r in reports) == world_size
