"""Named fault-injection points for the fault matrix (tests and scripts only).

Configuration
-------------
:func:`configure` (this process) or the ``DIST_CKPT_FAULTS`` environment variable (read at
each hit while nothing was configured; parsed once per value) holds a JSON object mapping a
point to a spec. Every key of a spec is optional:

``rank``            fire on this rank only (an int, or a list of ints);
``after``           let that many (rank-matching) hits of the point pass first;
``block``           ``true`` or a block name (default: the point's name): block until released,
                    see "Blocking" below; the other keys act after the release;
``block_timeout_s`` how long a block waits for its release (default 120 s), then it raises
                    :class:`FaultInjected`;
``delay_s``         sleep (an injected slow rank; never a way to order events in a test);
``kill``            SIGKILL this process; ``exit``: ``os._exit(code)``;
``raise``           raise :class:`FaultInjected`;
``truncate``        read by the caller through :func:`hit`'s return value (``upload.file``).

:func:`hit` returns the spec that fired, or ``{}``. With nothing configured a point costs
what it cost before blocking existed: one environment lookup and one dict lookup.
``configure(None)`` (or a new ``configure``) resets the hit counts and the in-process
reached/released state, and lets every point blocked in this process go on.

Blocking
--------
A blocked point records that it was reached, then waits for its release:

- in-process: arrivals per block name and rank under a condition variable, so a thread of
  the same process waits with :func:`wait_reached` and releases with :func:`release`;
- across processes, when a fault directory is known (the ``fault_dir`` argument of
  :func:`configure`, else ``DIST_CKPT_FAULT_DIR``): the file ``<dir>/<name>.reached.<rank>``
  is created when reached, and the point waits until ``<dir>/<name>.release`` exists (polled
  every 20 ms). :func:`wait_reached` and :func:`release` with ``fault_dir=`` (or the same
  environment variable) do the test's side from another process.

Once released, a block name no longer blocks (every later hit passes), until ``configure``
resets it (in-process) or the release file is removed. Use a fresh name or directory per
scenario: reached markers in a directory persist. :func:`reached` lists arrivals without
waiting; ``wait_reached(..., count=2)`` waits for two arrivals (two threads of one process);
:func:`hits` counts the hits of every point. A test, in-process::

    faults.configure({"write.before": {"block": "held"}})
    job = mgr.save(1)                     # async: returns with the writer held
    faults.wait_reached("held")           # the writer is at write.before, nothing written
    mutate_the_live_tensors()             # ... whatever must happen while it is held
    faults.release("held"); mgr.wait()

Across processes, the job gets ``DIST_CKPT_FAULTS='{"report.before": {"rank": 1, "block":
"r"}}'`` and ``DIST_CKPT_FAULT_DIR=D``; the test calls ``faults.wait_reached("r", rank=1,
fault_dir=D)`` and ``faults.release("r", fault_dir=D)``.

Points (``rank`` below is the rank the point fires for; a spec's ``rank`` filters on it)
------------------------------------------------------------------------------------------
Save, all ranks (docs/architecture.md, "Save"):

``stage.before``            all ranks, main thread, in ``save()`` (``CheckpointManager._start``):
                            the agreement and the space check passed; no staging slot taken,
                            nothing copied, no plan prepared, no thread started.
``stage.copy``              all ranks, ``snapshot="lazy"`` only, first thing the save thread
                            does: ``save()`` returned, the deferred tensors not copied yet; the
                            next optimizer step and ``wait_staged()`` wait while it is held.
``stage.step_waits``        all ranks, ``snapshot="lazy"`` only, in the optimizer step's pre-hook
                            when the step arrives before a pending copy no longer reads the
                            live tensors (not hit when the copy was already done): the race
                            the lazy snapshot guards against is happening.
``write.before``            all ranks, first thing the writer does (the save thread of an async
                            save): the state is staged, the outcome pre-check passed, no byte
                            of this attempt is written.
``write.shards_written``    all ranks: the DCP shards are written and hashed; the state files
                            not yet (a mid-write point).
``write.after``             all ranks: shards and state files written and fsynced locally,
                            not yet handed to the tier (``put_files``).
``upload.file``             all ranks, object-store tier (and mirror uploads): before each
                            object upload of a rank's file (the file's rank); ``truncate``.
``report.before``           all ranks: files written and handed to the tier (or the error
                            caught), the ``RankReport`` not yet posted.
``report.after``            all ranks: the ``RankReport`` is posted; rank 0 has not started
                            collecting, the other ranks do not wait for the outcome yet.

Commit, rank 0 (``save/commit.py`` and the tier's ``publish``):

``commit.collected``        rank 0: every report collected (or the deadline passed), nothing
                            of the commit done yet; fires on failed collections too.
``commit.before_manifest``  rank 0: every rank reported, ``dcp/.metadata`` written locally,
                            not yet handed to the tier.
``commit.before_rename``    rank 0 (also a node-copy leader, reported as 0): rename tier:
                            signature, ``manifest.json`` written and every directory fsynced,
                            the pending directory not renamed; object-store tier (the save's
                            and the mirror's publish): before the signature and the
                            conditional create of the manifest.
``commit.after_rename``     rank 0: the commit point passed (rename tier: renamed and the root
                            fsynced; object-store tier, the mirror's too: the manifest created);
                            the size check and ``latest.json`` not done yet.
``commit.before_latest``    rank 0, rename tier: the published generation's sizes checked,
                            ``latest.json`` not yet replaced.

Mirror (``save/replay.py``, uploader threads):

``mirror.upload``           every rank, for each announced generation: this rank's local copy
                            is complete, none of its files uploaded (before ``put_files``).
``mirror.before_publish``   rank 0: every rank reported a successful upload; the remote
                            manifest not yet created. ``raise`` fails that upload.

Memory tier ring (``ops/replica.py``, the janitor thread of each node's leader):

``ring.push``               the node leader's rank: before it sends its newest in-memory
                            generation to its ring successor. ``raise`` loses that replica
                            (the next pass, or ``close``, tries again).

Retention (``ops/retention.py``, ``prune``: the janitor thread of each filesystem leader,
rank 0's uploader for the mirror, or the CLI as rank 0):

``prune.manifest_removed``  the process's rank: a generation's manifest is deleted, its
                            files not yet (``_remove``; a deletion cut short here).
``prune.between``           the process's rank: after each generation or debris path was
                            deleted (manifest first), before the next one.

Restore (``restore/resume.py``, all ranks, main thread):

``restore.selected``        all ranks: ``select_generation`` returned (same choice and
                            rejections everywhere); nothing moved aside, nothing loaded.
``restore.before_load``     all ranks: rejections moved aside, pointer checked; the chosen
                            generation not yet loaded (before each load of a chosen
                            generation; not reached on a fresh start).

Points called without a rank resolve it only when a spec exists for them: the default
process group's rank when one is initialised, else ``$RANK``, else 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from .errors import DistCkptError

ENV = "DIST_CKPT_FAULTS"
DIR_ENV = "DIST_CKPT_FAULT_DIR"
BLOCK_TIMEOUT_S = 120.0
POLL_S = 0.02

_configured: dict[str, dict[str, Any]] | None = None
_configured_dir: str | None = None
_env_cache: tuple[str, dict[str, dict[str, Any]]] = ("", {})
_hits: dict[str, int] = {}
_lock = threading.Lock()
_cond = threading.Condition()  # guards the block state below
_reached: dict[str, dict[int, int]] = {}  # block name -> rank -> arrivals in this process
_released: set[str] = set()
_epoch = 0  # bumped by configure(): points blocked before it go on
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class FaultInjected(DistCkptError):
    """Raised by an injected fault (``raise``, or a block that was never released)."""


def configure(spec: dict[str, dict[str, Any]] | None, fault_dir: str | None = None) -> None:
    """Set this process's faults (None: back to ``DIST_CKPT_FAULTS``), and the directory of
    block markers (None: ``DIST_CKPT_FAULT_DIR``). Resets hit counts and in-process block
    state; points blocked in this process go on."""
    global _configured, _configured_dir, _epoch
    _configured = dict(spec) if spec is not None else None
    _configured_dir = fault_dir
    with _lock:
        _hits.clear()
    with _cond:
        _reached.clear()
        _released.clear()
        _epoch += 1
        _cond.notify_all()


def _from_env() -> dict[str, dict[str, Any]]:
    global _env_cache
    raw = os.environ.get(ENV)
    if not raw:
        return {}
    if raw != _env_cache[0]:
        _env_cache = (raw, json.loads(raw))
    return _env_cache[1]


def hit(point: str, rank: int | None = None) -> dict[str, Any]:
    """Apply the fault configured for ``point`` on ``rank`` (None: this process's rank);
    returns the spec that fired, else ``{}``."""
    spec = (_configured if _configured is not None else _from_env()).get(point)
    if not spec:
        return {}
    return _fire(point, _own_rank() if rank is None else rank, spec)


def _fire(point: str, rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    ranks = spec.get("rank")
    if ranks is not None and rank not in (ranks if isinstance(ranks, list) else [ranks]):
        return {}
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] <= int(spec.get("after", 0)):
            return {}
    if spec.get("block"):
        name = point if spec["block"] is True else str(spec["block"])
        _block(point, _check_name(name), rank, float(spec.get("block_timeout_s", BLOCK_TIMEOUT_S)))
    if spec.get("delay_s"):
        time.sleep(float(spec["delay_s"]))  # an injected slow rank, not synchronisation
    if spec.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.get("exit") is not None:
        os._exit(int(spec["exit"]))
    if spec.get("raise"):
        raise FaultInjected(f"fault injected at {point} on rank {rank}")
    return spec


def _own_rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never imports torch
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a group being torn down: fall back to the environment
        pass
    return int(os.environ.get("RANK", "0"))


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"block name {name!r}: letters, digits, '_', '.', '-' only")
    return name


def _dir(fault_dir: str | None) -> str | None:
    return fault_dir or _configured_dir or os.environ.get(DIR_ENV) or None


def _touch(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as handle:
        handle.write(json.dumps({"pid": os.getpid(), "unix": time.time()}))
    os.replace(tmp, path)  # a marker appears complete or not at all


def _block(point: str, name: str, rank: int, timeout_s: float) -> None:
    directory = _dir(None)
    with _cond:
        epoch = _epoch
    if directory:  # the marker first: whoever sees the arrival in-process sees the file too
        _touch(os.path.join(directory, f"{name}.reached.{rank}"))
    with _cond:
        ranks = _reached.setdefault(name, {})
        ranks[rank] = ranks.get(rank, 0) + 1
        _cond.notify_all()
    release_file = os.path.join(directory, f"{name}.release") if directory else None
    deadline = time.monotonic() + timeout_s
    with _cond:
        while name not in _released and _epoch == epoch:
            if release_file is not None and os.path.exists(release_file):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FaultInjected(f"fault point {point} on rank {rank}: block {name!r} was not "
                                    f"released within block_timeout_s={timeout_s:g}")
            _cond.wait(min(remaining, POLL_S))


def reached(name: str, fault_dir: str | None = None) -> list[int]:
    """The ranks that reached block ``name`` so far, once per arrival in this process (two
    threads of one rank: ``[0, 0]``) and once per marker in the fault directory."""
    _check_name(name)
    with _cond:
        counts = dict(_reached.get(name, {}))
    directory = _dir(fault_dir)
    if directory and os.path.isdir(directory):
        prefix = f"{name}.reached."
        for entry in os.listdir(directory):
            if entry.startswith(prefix) and entry[len(prefix):].isdigit():
                rank = int(entry[len(prefix):])
                counts[rank] = max(counts.get(rank, 0), 1)
    return sorted(rank for rank, count in counts.items() for _ in range(count))


def wait_reached(name: str, rank: int | Iterable[int] | None = None, timeout_s: float = 60.0,
                 fault_dir: str | None = None, count: int = 1) -> list[int]:
    """Wait until block ``name`` was reached ``count`` times: in all (``rank`` None) or by each
    of ``rank`` (an int or several); returns :func:`reached`. ``TimeoutError`` after
    ``timeout_s``."""
    want = None if rank is None else ([rank] if isinstance(rank, int) else list(rank))
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = reached(name, fault_dir)
        if (len(ranks) >= count) if want is None else all(ranks.count(r) >= count for r in want):
            return ranks
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"block {name!r} not reached {count} time(s) by "
                               f"{'any rank' if want is None else f'rank(s) {want}'} within "
                               f"{timeout_s:g} s (reached: {ranks})")
        with _cond:
            _cond.wait(min(remaining, POLL_S))


def hits() -> dict[str, int]:
    """Hits per point since the last ``configure`` (those a spec's ``rank`` matched, counting
    the ones ``after`` let pass): with ``{"after": 10**9}`` a spec only counts."""
    with _lock:
        return dict(_hits)


def release(name: str, fault_dir: str | None = None) -> None:
    """Release block ``name``: in this process, and through ``<dir>/<name>.release`` when a
    fault directory is known (argument, ``configure``, or ``DIST_CKPT_FAULT_DIR``)."""
    _check_name(name)
    directory = _dir(fault_dir)
    if directory:
        _touch(os.path.join(directory, f"{name}.release"))
    with _cond:
        _released.add(name)
        _cond.notify_all()
