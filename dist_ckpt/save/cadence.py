"""The checkpoint interval model: how often to save.

The interval is Young's first-order optimum ``T* = sqrt(2 C M)`` for a save cost ``C`` and a
mean time between failures ``M``; at an interval ``T`` the expected fraction of time lost is
``C/T`` (saving) plus ``T/(2M)`` (on average half an interval of work is redone after a
failure). The model holds while ``C`` is small against ``M``.

Used by the save schedule (``save/schedule.py``, ``cadence="auto"``) and by the offline cost
estimate of ``dist-ckpt plan`` (``cli/costs.py``).
"""

from __future__ import annotations

import math


def check_positive(name: str, value: float) -> float:
    """``value`` as a float; ValueError naming ``name`` unless it is a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def t_star(save_cost_s: float, mtbf_s: float) -> float:
    """Young's overhead-minimising checkpoint interval sqrt(2*C*M) in seconds."""
    return math.sqrt(2 * check_positive("save_cost_s", save_cost_s) * check_positive("mtbf_s", mtbf_s))


def interval_updates(interval_s: float, step_time_s: float) -> int:
    """Interval in updates: max(1, round(interval_s / step_time_s))."""
    return max(1, round(check_positive("interval_s", interval_s)
                        / check_positive("step_time_s", step_time_s)))


def lost_fraction(interval_s: float, save_cost_s: float, mtbf_s: float) -> float:
    """Expected fraction of time lost to saving plus rework: C/T + T/(2M) (first-order model)."""
    interval = check_positive("interval_s", interval_s)
    save_cost = check_positive("save_cost_s", save_cost_s)
    return save_cost / interval + interval / (2 * check_positive("mtbf_s", mtbf_s))
