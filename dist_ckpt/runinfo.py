"""What a worker tells the launcher (``python -m launch``) about one start of a job.

The launcher exports ``DIST_CKPT_LAUNCH_DIR``, a directory private to one start on this node.
Each rank writes only its own ``rank-NNNNN.json`` there (atomic replace, so the launcher never
reads a torn file): where it checkpoints, the contract digest, which generation it resumed
from, and, when the library raises an error that no restart can cure (bad config, changed
contract, torch version refused, no space, a signing key that rejects every generation), the
error's name and message. The launcher reads these files after the start ends; it never parses
logs. Outside the launcher every function here is a no-op.

Call order: any rank, any time, from the main thread; ``report`` merges fields into the rank's
file, so later calls add to earlier ones.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, TypedDict, cast

from . import logs
from .errors import (
    ConfigError,
    ContractMismatch,
    DistCkptError,
    InsufficientSpace,
    LayoutMismatch,
    NoValidGeneration,
    TorchVersionMismatch,
    UntrustedGenerations,
    error_name,
)
from .storage.local import atomic_write

log = logs.get(__name__)

LAUNCH_DIR_ENV = "DIST_CKPT_LAUNCH_DIR"
RUN_ID_ENV = "DIST_CKPT_RUN_ID"
MIRROR_ENV = "DIST_CKPT_MIRROR"
REPORT_PREFIX = "rank-"
PREEMPT_NOTICE_NAME = "preempt"  # written by the launcher in the start's directory: save, then stop


class WorkerFailure(TypedDict):
    error: str  # the exception's class name
    message: str
    permanent: bool  # one of PERMANENT_ERRORS: the launcher does not start again


class WorkerReport(TypedDict, total=False):
    """One rank's ``rank-NNNNN.json``; every field but ``rank`` is absent until written."""

    rank: int  # the writer's global rank (always present in a file read back)
    root: str  # where it checkpoints (``CheckpointConfig.root``), written when the manager opens
    mirror: str | None
    world_size: int
    pid: int
    contract_digest: str  # of the training state's contract: which run a DONE record belongs to
    resumed_from: str | None  # the generation it resumed from, None for a fresh start
    next_update: int  # the update it resumed at
    resumed_tier: str | None  # the kind of tier the generation was read from ("memory", "local", ...)
    rejected: list[str]  # the restore's rejections, as text
    repaired: str | None  # "repaired N file(s) of gen-... from <tier>", None when none was
    done: str  # the final generation ``finish()`` recorded in DONE.json
    failure: WorkerFailure
    memory_tier: bool  # the job saves to the node's memory tier
    committed_update: int  # rank 0: the newest generation committed in any tier (memory too)
    preempted: str  # the generation saved for a preemption
    preempted_update: int


# failures a restart cannot cure: the launcher stops instead of starting again
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, ContractMismatch, LayoutMismatch, TorchVersionMismatch, InsufficientSpace,
    UntrustedGenerations, NoValidGeneration)


def launch_dir() -> str | None:
    return os.environ.get(LAUNCH_DIR_ENV) or None


def preempt_notice_path() -> str | None:
    """Where the launcher's preemption notice for this start appears; None outside it."""
    directory = launch_dir()
    return None if directory is None else os.path.join(directory, PREEMPT_NOTICE_NAME)


def under_launcher() -> bool:
    return launch_dir() is not None


def env_rank() -> int:
    """This process's global rank as torchrun exported it (0 outside torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{REPORT_PREFIX}{rank:05d}.json")


def report(rank: int | None = None, **fields: Any) -> None:
    """Merge ``fields`` into this rank's report; failures to write are logged, never raised
    (a report must not turn a save or a restore into a failure)."""
    directory = launch_dir()
    if directory is None:
        return
    rank = env_rank() if rank is None else rank
    path = report_path(directory, rank)
    try:
        current = read_report(path) or {}
        current.update(fields, rank=rank)
        os.makedirs(directory, exist_ok=True)
        atomic_write(path, json.dumps(current, default=str).encode())
    except OSError as exc:
        log.warning("cannot write the launcher report %s: %s", path, exc)


def is_permanent(exc: BaseException) -> bool:
    """No restart cures ``exc``: one of ``PERMANENT_ERRORS``, or an agreed refusal that says so."""
    return isinstance(exc, PERMANENT_ERRORS) or getattr(exc, "permanent", False) is True


def report_failure(exc: BaseException, rank: int | None = None) -> None:
    """Record an error this rank is about to raise, marked permanent when no restart helps.
    Under the launcher, the same error left uncaught prints one line from rank 0 instead of
    a traceback from every rank (:func:`print_refusal_once`): it is an expected refusal whose
    whole reason the launcher's summary repeats."""
    report(rank, failure={"error": error_name(exc), "message": str(exc), "permanent": is_permanent(exc)})
    if is_permanent(exc) and under_launcher():
        print_refusal_once(exc, env_rank() if rank is None else rank)


def reports_permanent(method):
    """Decorator of the manager's public methods: tell the launcher about an error no restart
    can cure before raising it."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except DistCkptError as exc:
            if is_permanent(exc):
                report_failure(exc)
            raise
    return wrapper


def print_refusal_once(refusal: BaseException, rank: int) -> None:
    """If ``refusal`` ends the process uncaught: one line on rank 0 (``[dist_ckpt] rank 0:
    Kind: reason``), nothing on the other ranks, exit status 1 as for any uncaught error.
    Any other uncaught exception goes to the hook that was there before."""
    previous = sys.excepthook

    def hook(kind, value, traceback):  # noqa: ANN001 - sys.excepthook's signature
        if value is not refusal:
            previous(kind, value, traceback)
            return
        if rank == 0:
            print(f"[dist_ckpt] rank 0: {error_name(value)}: {value}", file=sys.stderr, flush=True)

    sys.excepthook = hook


def read_report(path: str) -> dict[str, Any] | None:
    """A JSON object from ``path``; None when absent, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def read_reports(directory: str) -> dict[int, WorkerReport]:
    """Every rank report of one start on this node, by rank (the launcher, after the start)."""
    reports: dict[int, WorkerReport] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return reports
    for name in sorted(names):
        if name.startswith(REPORT_PREFIX) and name.endswith(".json"):
            loaded = read_report(os.path.join(directory, name))
            if loaded is not None and isinstance(loaded.get("rank"), int):
                reports[loaded["rank"]] = cast(WorkerReport, loaded)
    return reports
