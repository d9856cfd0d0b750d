"""The offline cost estimate of ``dist-ckpt plan``: time lost, disk needed and per-storage-class
figures over a whole run, at the interval of the model in ``save/cadence.py``.

Disk needed under one root: ``(keep_last + milestones) x generation + staging``, where the
milestones are the multiples of ``keep_every`` within the run (an upper bound: it assumes a
save lands on each multiple) and staging is one more generation, the save in flight. On an
incremental root (docs/incremental.md) the shared objects a generation references are stored
once, not once per generation: ``(keep_last + milestones + 1) x own + shared``, with ``own`` the
generation's bytes below it and ``shared`` its referenced objects (it assumes the frozen part
stays as it is over the run).

Per-storage figures come from a user-supplied JSON file, the tiers file of ``--tiers`` (no
prices are built in; they change)::

    {"tiers": [
      {"name": "local NVMe", "read_bytes_per_s": 2e9},
      {"name": "S3 standard", "read_bytes_per_s": 5e8, "usd_per_gb_month": 0.023,
       "usd_per_1000_put": 0.005, "usd_per_1000_get": 0.0004}
    ]}

``name`` and ``read_bytes_per_s`` (restore bandwidth, bytes/s) are required; the three prices
are optional and costs are reported only for the prices given. GB means 2**30 bytes and a
month 1/12 of 365.25 days, as object stores bill storage.

Call order: the ``plan`` command only (``cli/forecast.py``), offline; nothing at training time.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from ..save.cadence import check_positive, interval_updates, lost_fraction, t_star

GB = 1 << 30
MONTH_S = 365.25 * 86400 / 12
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*([0-9.eE+-]+)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(text: str) -> float:
    """'10' or '10s' -> 10.0; '0.8s', '500ms', '5m', '4h', '30d' -> seconds. ValueError with a clear
    message otherwise (negative/zero/garbage)."""
    hint = "expected a positive number with an optional unit ms, s, m, h or d (e.g. 0.8s, 500ms, 4h)"
    match = _DURATION_RE.match(text)
    try:
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"] if match else math.nan
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: {hint}")
    return seconds


def median_save_cost(durations: Iterable[float]) -> tuple[float, int] | None:
    """Median of the recorded save durations and how many there were; None when none is usable
    (a zero or negative duration is not a measurement)."""
    usable = [d for d in durations if math.isfinite(d) and d > 0]
    return (statistics.median(usable), len(usable)) if usable else None


@dataclass(frozen=True)
class LaunchLogStep:
    step_time_s: float
    launches: int
    updates: int
    duration_s: float


def step_time_from_log(text: str) -> LaunchLogStep | None:
    """Seconds per update from a launcher log (JSON lines): sum(duration_s) / sum(updates) over
    the lines with a numeric ``duration_s`` > 0 and an integer ``updates`` > 0. Other lines
    (malformed, or launches that made no progress) are ignored; None when none is usable."""
    duration, updates, launches = 0.0, 0, 0
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        secs, count = record.get("duration_s"), record.get("updates")
        if isinstance(secs, bool) or not isinstance(secs, int | float) or not math.isfinite(secs) \
                or secs <= 0:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            continue
        duration, updates, launches = duration + secs, updates + count, launches + 1
    return LaunchLogStep(duration / updates, launches, updates, duration) if updates else None


class StoragePrice(BaseModel):
    """One row of the user's tiers file: a storage class's restore bandwidth and optional prices."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str = Field(min_length=1)
    read_bytes_per_s: float = Field(gt=0)
    usd_per_gb_month: float | None = Field(default=None, ge=0)
    usd_per_1000_put: float | None = Field(default=None, ge=0)
    usd_per_1000_get: float | None = Field(default=None, ge=0)


class _TiersFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tiers: list[StoragePrice] = Field(min_length=1)


def parse_storage_prices(text: str | bytes) -> list[StoragePrice]:
    """The rows of a tiers file; ValueError naming the first problem (field path and reason)."""
    try:
        return _TiersFile.model_validate_json(text).tiers
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".")
        raise ValueError(f"{where or 'file'}: {first['msg']}") from None


@dataclass
class PriceEstimate:
    """Figures for one storage class over the run; None where an input (size, files, price) is
    unknown."""

    name: str
    read_bytes_per_s: float
    restore_s: float | None
    gb_months: float | None
    put_requests: float | None
    get_requests: float | None
    storage_usd: float | None = None
    put_usd: float | None = None
    get_usd: float | None = None
    total_usd: float | None = None


@dataclass
class CostEstimate:
    """Every figure ``dist-ckpt plan`` prints; its field names are the keys of ``--json``."""

    save_cost_s: float
    mtbf_s: float
    run_length_s: float
    step_time_s: float | None
    interval_s: float
    interval_updates: int | None
    lost_fraction: float
    lost_saving_fraction: float
    lost_rework_fraction: float
    saves: float  # over the run at T*
    restores: float  # expected over the run: run length / MTBF
    run_updates: int | None
    keep_last: int
    keep_every: int | None
    milestones: int
    generation_bytes: int | None
    shared_bytes: int  # of generation_bytes: shared objects, stored once for every generation
    files_per_generation: int | None
    kept_bytes: int | None  # keep_last generations (their shared objects once)
    milestone_bytes: int | None
    staging_bytes: int | None  # one more generation's own bytes: the save in flight
    disk_bytes: int | None
    tiers: list[PriceEstimate] = field(default_factory=list)  # "tiers": the --json key users parse
    sources: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _cost(count: float | None, price: float | None) -> float | None:
    return None if count is None or price is None else count * price


def price_estimate(price: StoragePrice, *, generation_bytes: int | None, files_per_generation: int | None,
                   retained_generations: float, saves: float, restores: float,
                   run_length_s: float, shared_bytes: int = 0, shared_files: int = 0) -> PriceEstimate:
    """Storage, requests and restore time of one storage class over the run (a save puts
    its own files only: the shared objects it references are there already; a restore gets
    them all)."""
    size = generation_bytes
    gb_months = None if size is None else \
        (retained_generations * (size - shared_bytes) + shared_bytes) / GB * run_length_s / MONTH_S
    puts = None if files_per_generation is None else (files_per_generation - shared_files) * saves
    gets = None if files_per_generation is None else files_per_generation * restores
    restore_s = None if size is None else size / price.read_bytes_per_s
    costs = {"storage_usd": _cost(gb_months, price.usd_per_gb_month),
             "put_usd": _cost(None if puts is None else puts / 1000, price.usd_per_1000_put),
             "get_usd": _cost(None if gets is None else gets / 1000, price.usd_per_1000_get)}
    known = [c for c in costs.values() if c is not None]
    return PriceEstimate(price.name, price.read_bytes_per_s, restore_s, gb_months, puts, gets, **costs,
                         total_usd=sum(known) if known else None)


def estimate_costs(*, save_cost_s: float, mtbf_s: float, run_length_s: float,
                   step_time_s: float | None = None, generation_bytes: int | None = None,
                   files_per_generation: int | None = None, keep_last: int = 3,
                   keep_every: int | None = None, prices: Sequence[StoragePrice] = (),
                   sources: dict[str, str] | None = None, shared_bytes: int = 0,
                   shared_files: int = 0) -> CostEstimate:
    """Every figure of the estimate; ValueError naming the argument for a non-positive input."""
    check_positive("run_length_s", run_length_s)
    for name, count in (("keep_last", keep_last), ("keep_every", keep_every)):
        if count is not None and count < 1:
            raise ValueError(f"{name} must be at least 1, got {count}")
    if generation_bytes is not None and generation_bytes < 0:
        raise ValueError(f"generation_bytes must not be negative, got {generation_bytes}")
    if not 0 <= shared_files <= (files_per_generation or 0):
        raise ValueError(f"shared_files must be between 0 and files_per_generation "
                         f"({files_per_generation}), got {shared_files}")
    if not 0 <= shared_bytes <= (generation_bytes or 0):
        raise ValueError(f"shared_bytes must be between 0 and generation_bytes ({generation_bytes}), "
                         f"got {shared_bytes}")
    interval = t_star(save_cost_s, mtbf_s)
    run_updates = None if step_time_s is None else \
        math.floor(run_length_s / check_positive("step_time_s", step_time_s))
    milestones = run_updates // keep_every if run_updates is not None and keep_every else 0
    size = generation_bytes
    own = None if size is None else size - shared_bytes
    estimate = CostEstimate(
        save_cost_s=save_cost_s, mtbf_s=mtbf_s, run_length_s=run_length_s, step_time_s=step_time_s,
        interval_s=interval,
        interval_updates=None if step_time_s is None else interval_updates(interval, step_time_s),
        lost_fraction=lost_fraction(interval, save_cost_s, mtbf_s),
        lost_saving_fraction=save_cost_s / interval, lost_rework_fraction=interval / (2 * mtbf_s),
        saves=run_length_s / interval, restores=run_length_s / mtbf_s, run_updates=run_updates,
        keep_last=keep_last, keep_every=keep_every, milestones=milestones,
        generation_bytes=size, shared_bytes=shared_bytes, files_per_generation=files_per_generation,
        kept_bytes=None if own is None else keep_last * own + shared_bytes,
        milestone_bytes=None if own is None else milestones * own,
        staging_bytes=own,
        disk_bytes=None if own is None else (keep_last + milestones + 1) * own + shared_bytes,
        sources=dict(sources or {}))
    # milestones accrue evenly over the run, so on average half of them are stored
    retained = keep_last + milestones / 2
    estimate.tiers = [price_estimate(p, generation_bytes=size, files_per_generation=files_per_generation,
                                     retained_generations=retained, saves=estimate.saves,
                                     restores=estimate.restores, run_length_s=run_length_s,
                                     shared_bytes=shared_bytes, shared_files=shared_files)
                      for p in prices]
    every = estimate.interval_updates
    if every and keep_every and keep_every % every:
        estimate.notes.append(f"saves every {every} updates land on a multiple of keep_every {keep_every} "
                              f"only every {math.lcm(every, keep_every)} updates; make keep_every a multiple "
                              "of the save interval to keep the milestones counted here")
    if interval > mtbf_s / 2:
        estimate.notes.append("T* is not small against the MTBF: the first-order model is optimistic; "
                              "make saves cheaper or failures rarer")
    return estimate
