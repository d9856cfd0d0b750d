"""Checks on the facts every rank contributes to the all-gather at ``save()``.

Call order: each rank adds its facts in ``save.facts.gather_start``; after the all-gather
every rank runs the same checks on the same list, so all ranks raise the same error or none.
"""

from __future__ import annotations

from typing import Any

from ..errors import RankMismatch
from ..protocol.messages import SaveFacts
from ..restart.contract import field_digest


def extras_digests(extras: dict[str, Any]) -> dict[str, str]:
    """One digest per key: enough to name the keys that differ, small to gather."""
    return {str(key): field_digest(value) for key, value in sorted(extras.items())}


def check_extras(agreed: list[SaveFacts]) -> None:
    """``extras`` is one value for the whole job and rank 0 writes it: a rank whose extras
    differ would be silently overwritten on restore, so the save is refused instead."""
    reference = agreed[0].extras
    differing: dict[int, list[str]] = {}
    for rank, facts in enumerate(agreed[1:], start=1):
        keys = set(reference) | set(facts.extras)
        changed = sorted(k for k in keys if reference.get(k) != facts.extras.get(k))
        if changed:
            differing[rank] = changed
    if differing:
        raise RankMismatch("TrainState.extras must be the same on every rank (rank 0's is saved); "
                           "keys that differ from rank 0's", differences=differing)
