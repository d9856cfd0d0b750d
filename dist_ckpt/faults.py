"""Named fault-injection points for the fault matrix (tests and scripts only).

The library calls :func:`hit` at named points of the save, commit, mirror, ring, prune and
restore paths; with nothing configured (:func:`configure` or ``DIST_CKPT_FAULTS``) a point
costs one environment lookup and one dict lookup. A configured point can delay, raise, exit,
SIGKILL the process, truncate an upload, or block until the test releases it
(:func:`wait_reached`, :func:`release`; across processes through ``DIST_CKPT_FAULT_DIR``), so
tests order events by blocking, never by a delay being long enough.

The spec keys, the blocking protocol and the catalogue of points (where each fires, on which
ranks, and what holds at that moment): docs/faults.md.
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


def armed(point: str) -> bool:
    """Whether a fault is configured for ``point`` now: a path that would hit it thousands of
    times (each write request of a file) asks once, then hits only when armed."""
    return bool((_configured if _configured is not None else _from_env()).get(point))


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
