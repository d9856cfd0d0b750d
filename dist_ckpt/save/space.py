"""Free-space preflight: refuse a save that cannot fit before anything is written.

Protocol: every rank puts its ``SpaceFacts`` (or None when it cannot estimate)
into the manager's pre-save all-gather; every rank then runs :func:`check_space` on the same
gathered facts, so all ranks raise the same :class:`InsufficientSpace` or none does. A
filesystem's leader (its lowest rank) measures the free space; the need is the sum of what
the ranks writing there will write under the cached plan, plus the configured headroom.
"""

from __future__ import annotations

from ..errors import InsufficientSpace
from ..protocol.messages import SaveFacts


def check_space(agreed: list[SaveFacts], headroom_bytes: int, root: str) -> None:
    facts = [f.space for f in agreed]
    if any(f is None for f in facts):
        return  # some rank has no estimate yet (first save of this layout) or checks are off
    need: dict[int, int] = {}
    free: dict[int, int] = {}
    for fact in facts:
        assert fact is not None
        need[fact.leader] = need.get(fact.leader, 0) + fact.bytes
        if fact.free is not None:
            free[fact.leader] = fact.free
    shortfalls = {
        leader: f"{need[leader] + headroom_bytes} bytes needed (one generation + headroom), "
                f"{free[leader]} free"
        for leader in sorted(need) if leader in free and free[leader] < need[leader] + headroom_bytes
    }
    if shortfalls:
        raise InsufficientSpace(f"not enough free space under {root} for one more generation",
                                shortfalls=shortfalls)
