"""Every rank's message to rank 0, and rank 0's verdict back, one store key per node.

Why: with W ranks, rank 0 reading W keys one by one, or W ranks each reading rank 0's
verdict from the store, costs one store thread O(W) requests and bytes per event at rank 0
alone; the node leaders (``protocol/node.py``) take the per-rank part, so rank 0 and the
store see one key per node.

Call order for one exchange named ``scope`` (a save's generation and attempt, a replay's
channel and sequence number):

1. ``post`` (every rank but the node leaders): its message under ``rank_key(scope, rank)``,
   one request; a node leader keeps its own in memory instead.
2. ``forward`` (every node leader but rank 0's): one blocking wait for its members' keys
   (``Comm.blocking_wait``, on a connection of its own) until all are in or the deadline,
   one ``multi_get`` of them, one node message (each member's raw message, the missing
   ranks) under ``node_key(scope, leader)``, and the members' keys deleted.
3. ``gather`` (rank 0): its own node's members as in 2, then one blocking wait for the other
   nodes' keys until all are in or the deadline (plus ``GRACE_S`` for the leaders' own
   collection), then one ``multi_get`` of the node keys that arrived. A node that did not
   arrive counts all its ranks missing.

No rank polls while it waits: a save costs the store about 3 requests per rank (post, read
and delete by the leader) plus a few per node, whatever it takes.

Rank 0's verdict goes back the other way: one store key that only the node leaders read, each
relaying it to its node through the node directory (``Node.relay_post`` / ``relay_wait``);
the save's coordinator owns that step (``save/coordinator.py``).
"""

from __future__ import annotations

import json
import time

from .comm import Comm
from .messages import Collected

GRACE_S = 2.0  # rank 0 waits this much longer than the leaders (they post after their deadline)


def rank_key(scope: str, rank: int) -> str:
    return f"{scope}/report/{rank}"


def node_key(scope: str, leader: int) -> str:
    return f"{scope}/node/{leader}"


def post(comm: Comm, scope: str, raw: bytes) -> None:
    """Step 1 (every rank but node leaders; leaders pass ``raw`` to ``forward``/``gather``)."""
    if not comm.node.is_leader:
        comm.store_set(rank_key(scope, comm.rank), raw)


def _collect_members(comm: Comm, scope: str, own: bytes, deadline: float) -> Collected:
    members = [r for r in comm.node.layout.members if r != comm.rank]
    keys = {rank: rank_key(scope, rank) for rank in members}
    late = set(comm.blocking_wait(list(keys.values()), deadline - time.monotonic()))
    arrived = [rank for rank in members if keys[rank] not in late]
    values = comm.store.multi_get([keys[r] for r in arrived]) if arrived else []
    for rank in arrived:
        comm.store.delete_key(keys[rank])
    received = {comm.rank: own, **dict(zip(arrived, values, strict=True))}
    return Collected(received, sorted(r for r in members if keys[r] in late))


def forward(comm: Comm, scope: str, own: bytes, deadline: float) -> Collected:
    """Step 2 (node leaders other than rank 0's); returns what it found of its node."""
    found = _collect_members(comm, scope, own, deadline)
    node = {"received": {str(r): raw.decode("utf-8") for r, raw in found.received.items()},
            "missing": found.missing}
    comm.store_set(node_key(scope, comm.rank), json.dumps(node).encode("utf-8"))
    return found


def gather(comm: Comm, scope: str, own: bytes, deadline: float) -> tuple[Collected, list[int]]:
    """Step 3 (rank 0): every rank's raw message, by rank, and the ranks missing; and the
    ranks of rank 0's own node that reported."""
    found = _collect_members(comm, scope, own, deadline)
    own_node = sorted(found.received)
    leaders = [leader for leader in comm.node.layout.leaders if leader != comm.rank]
    if not leaders:
        return found, own_node
    keys = [node_key(scope, leader) for leader in leaders]
    absent = set(comm.blocking_wait(keys, deadline + GRACE_S - time.monotonic()))
    present = [key for key in keys if key not in absent]
    for key, raw in zip(present, comm.store.multi_get(present) if present else [], strict=True):
        node = json.loads(raw)
        found.received.update({int(r): m.encode("utf-8") for r, m in node["received"].items()})
        found.missing.extend(int(r) for r in node["missing"])
        comm.store.delete_key(key)
    for leader, key in zip(leaders, keys, strict=True):
        if key in absent:
            found.missing.extend(comm.node.layout.members_of(leader))
    found.missing.sort()
    return found, own_node
