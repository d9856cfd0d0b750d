"""The memory tier across nodes: a ring of replicas, and in-memory restores that fetch from peers.

Each node's memory holds the manifest and that node's ranks' files of an in-memory generation.
A restore from memory then needs, on every node, the generation's common files (DCP
``.metadata``, the global train state: rank 0's node wrote them) and now and then a shard of
another node (DCP writes a replicated tensor, such as an optimizer step count, once, in one
rank's file). With ``memory_replica``, each node's leader also keeps a copy of its ring
predecessor's files of the newest in-memory generation (``<memory root>.replica/G/``), so a
node that lost its memory (a replaced machine, a launcher that died) is rebuilt from it.

Every transfer crosses the peer channel (``memory/peer.py``) on process groups of the node
leaders made for it (``Comm.new_group``, ``peer_backend``): one for the restore exchange, with
the restore's deadline (the checkpoint group's timeout), and the ring groups of replication
(``memory/replicas.py``), with ``RING_TIMEOUT_S``. No listener, no address, no token.

Call order:
- ``NodeRing(...)`` on every rank, once, after the filesystem groups are known (collective:
  every rank creates the groups, in the same order, when there is more than one node; each
  leader starts its replica receiver);
- ``push_newest`` then ``settle_replicas`` on each leader in the manager's pruning thread
  after each committed save, before the memory prune (so the generation being sent is never
  deleted meanwhile): this node's files of its newest committed in-memory generation go to
  the ring successor, manifest last (a replica's commit point), and the successor counts it
  in the store as the sender's newest replica; received replicas are renamed to their
  generation's name and older ones dropped;
- ``protected`` in the memory prune (leaders): this node keeps its own copy of every
  generation from the oldest of the other nodes' newest replicas on (``keep_for_rebuild``);
  the first leader reads the records and publishes their floor, the others read the floor.
  Replicas of different nodes may be of different generations (a push skips to the newest);
  without it, a node lost while its newest replica was still on the way, or whose replicas
  lag the others', would leave no generation whole: its successor holds an older one, which
  every other node already deleted;
- ``repair()`` on every rank at the start of ``restore()`` (collective): every leader's
  inventory is all-gathered, rank 0 routes one exchange (``memory/routes.py``: the newest
  generation the nodes can complete, which node sends which file to which) and broadcasts
  it, and the leaders run it (``memory/exchange.py``). Each file is checked against the
  manifest before it is installed; selection and the load check sizes and digests as always;
- ``fetch_for_load`` from the memory tier's reader while DCP loads (any rank): another node's
  shard file this node's load reads, as the exchange left it (nothing crosses the network then);
- ``after_restore`` (every rank; leaders also ``drop_newer_replicas``), and ``close`` on every
  rank when the manager closes: the last push, then a store handshake so that a leader keeps
  receiving until its predecessor's last push is in.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterable

import torch

from .. import faults, logs
from ..errors import ConfigError, DistCkptError
from ..format.manifest import (
    MANIFEST_NAME,
    PENDING_PREFIX,
    Manifest,
    generation_name,
    parse_generation,
    pending_dir_name,
    pending_update,
)
from ..format.signing import SIGNATURE_NAME
from ..format.validate import list_generations
from ..protocol.comm import Comm
from .exchange import Outcome, Places, run_exchange
from .peer import PeerChannel
from .replicas import RING_FLOOR_KEY, Receiver, ReplicaRecords, Sender, ring_group_index, ring_groups_needed
from .routes import ExchangeRoutes, Inventory, Manifests, inventory, route_exchange, wanted_manifests
from .tier import MemoryTier, remove_newer

log = logs.get(__name__)
RING_KEEP = 2  # own committed in-memory generations a leader keeps for the ring at least
RING_KEEP_MAX = 4  # and at most: a replication lagging further leaves a lost node to the root
RING_TIMEOUT_S = 120.0  # the ring groups' deadline for one transfer
CLOSE_WAIT_S = 30.0  # how long a closing leader keeps receiving its predecessor's last push


def peer_device(backend: str) -> torch.device:
    """Where the peer channel's tensors live: the CPU for gloo, this rank's GPU for NCCL."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise ConfigError(f"peer_backend={backend!r} needs CUDA on every rank (this one has none); "
                      "use \"gloo\" (field peer_backend)")


class NodeRing:
    def __init__(self, comm: Comm, tier: MemoryTier, *, replicate: bool, backend: str = "gloo") -> None:
        self.comm = comm
        self.tier = tier
        self.replica_root = tier.root.rstrip("/") + ".replica"
        self.leader_of = comm.all_gather(comm.fs_leader)  # rank -> its node's leader
        self.leaders = sorted(set(self.leader_of))
        self.is_leader = comm.rank == comm.fs_leader
        self.nodes = len(self.leaders)
        self.replicating = replicate and self.nodes > 1
        position = self.leaders.index(comm.fs_leader)
        self.successor = self.leaders[(position + 1) % self.nodes]  # holds this node's replica
        self.predecessor = self.leaders[position - 1]  # whose replica this node holds
        self.channel: PeerChannel | None = None  # the restore exchange's (leaders)
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        if self.nodes > 1:  # the same on every rank: one node needs no group, no collective
            self._open_groups(backend, position)
        self._pushed: str | None = None
        # the two lowest replica records (sender leader -> generation), as last read or computed
        self._floor: dict[int, str] = {}
        self._floor_seen = False  # RING_FLOOR_KEY exists (it is never deleted): no check first
        self._records = ReplicaRecords(comm.store, self.leaders)
        self.fetched = 0  # files this rank received from peers for a restore (logs, tests)
        self.repair_failures: list[str] = []  # why a node's copy could not be completed
        self.fetched_for_load: list[str] = []  # other nodes' shard files this rank's loads read
        self.push_lock = threading.Lock()
        self.fetched_dir = tier.root.rstrip("/") + ".fetched"  # shards of other nodes, per load

    def _open_groups(self, backend: str, position: int) -> None:
        """All ranks (collective): the leaders' groups, created by every rank in the same
        order; a rank that cannot use ``backend`` fails every rank before any is created."""
        comm = self.comm
        try:
            device: torch.device | str = peer_device(backend)
        except ConfigError as exc:
            device = str(exc)
        refused = {rank: d for rank, d in enumerate(comm.all_gather(str(device) if isinstance(device, str)
                                                                    else None)) if d is not None}
        if refused:  # on every rank: none waits in a group the others never create
            raise ConfigError(f"{next(iter(refused.values()))}; refused by rank(s) "
                              f"{', '.join(map(str, sorted(refused)))}")
        assert isinstance(device, torch.device)
        restore = comm.new_group(self.leaders, comm.timeout_s, backend)
        rings = [comm.new_group(self.leaders, RING_TIMEOUT_S, backend)
                 for _ in range(ring_groups_needed(self.nodes))]
        if not self.is_leader:
            return
        os.makedirs(self.replica_root, exist_ok=True)
        self.channel = PeerChannel(restore, device)
        if self.replicating:
            self.sender = Sender(comm, PeerChannel(rings[ring_group_index(position, self.nodes)], device),
                                 self.successor, RING_TIMEOUT_S + 60)
            behind = (position - 1) % self.nodes
            self.receiver = Receiver(comm, PeerChannel(rings[ring_group_index(behind, self.nodes)], device),
                                     self.predecessor, self.replica_root)
            self.receiver.start()

    def _committed(self) -> list[str]:
        """This node's in-memory generations with their manifest, newest first."""
        return [name for name in list_generations(self.tier.store)
                if os.path.exists(os.path.join(self.tier.root, name, MANIFEST_NAME))]

    def _members(self, leader: int) -> set[int]:
        """The ranks of the node ``leader`` leads."""
        return {rank for rank, lead in enumerate(self.leader_of) if lead == leader}

    # ---- replication (leaders, the manager's pruning thread) -------------------------------
    def push_newest(self) -> None:
        """Send this node's files of its newest committed in-memory generation to the ring
        successor, manifest last, once. It runs in the pruning thread before the memory prune,
        so the generation being sent is never deleted meanwhile; an older one not sent yet is
        skipped (only the newest is kept)."""
        if self.sender is None:  # not a replicating leader, or its transport failed
            return
        with self.push_lock:  # the pruning pass and close's last one
            self._push_newest()

    def _push_newest(self) -> None:
        newest = next(iter(self._committed()), None)
        if newest is None or newest == self._pushed:
            return
        directory = os.path.join(self.tier.root, newest)
        target = pending_dir_name(newest, uuid.uuid4().hex[:8])
        try:
            with open(os.path.join(directory, MANIFEST_NAME), "rb") as handle:
                manifest_raw = handle.read()
            manifest = Manifest.from_bytes(manifest_raw, generation=newest)
            group = self._members(self.comm.rank)
            paths = [f.path for f in manifest.files if f.rank in group]  # rank 0's: the common too
            if 0 in group and os.path.exists(os.path.join(directory, SIGNATURE_NAME)):
                paths.append(SIGNATURE_NAME)
            faults.hit("ring.push", self.comm.rank)
            assert self.sender is not None
            self.sender.push(newest, directory, target, paths)  # the manifest last: the commit point
            self._pushed = newest
        except (OSError, DistCkptError) as exc:  # a missed replica costs a restore from the root
            log.warning("no replica of %s on the node of rank %d: %s", newest, self.successor, exc)
        except RuntimeError as exc:  # the transport failed mid-file: the pair is out of step
            log.warning("replication to the node of rank %d stopped: %s", self.successor, exc)
            self.sender = None

    def protected(self) -> frozenset[str]:
        """Leaders (pruning or persistence thread, in the memory prune): this node's own
        committed generations to keep for another node lost meanwhile (``keep_for_rebuild``).
        The first leader reads every receiver's record (``ReplicaRecords.read``: one
        ``multi_get`` once all exist) and publishes the two lowest (``RING_FLOOR_KEY``); every
        other leader reads that one key, so a save costs the store O(N) requests in all, not
        one per pair of leaders. When the store fails (it lives on rank 0's node, which may
        be the one lost), the records last read decide."""
        if not self.replicating or not self.is_leader:
            return frozenset()
        try:
            if self.comm.rank == self.leaders[0]:
                self._floor = ring_floor(self._records.read())
                self.comm.store.set(RING_FLOOR_KEY, json.dumps(self._floor).encode())
            elif self._floor_seen or self.comm.store.check([RING_FLOOR_KEY]):
                self._floor = {int(k): v for k, v in json.loads(self.comm.store.get(RING_FLOOR_KEY)).items()}
                self._floor_seen = True
        except Exception:  # noqa: BLE001 - the store is gone (with rank 0's node): as last read
            log.warning("could not read the ring's replicas from the store; keeping what the "
                        "last records need", exc_info=True)
        return keep_for_rebuild(self._committed(), others_lowest(self._floor, self.comm.rank))

    def settle_replicas(self) -> None:
        """Leaders, pruning thread: the newest complete replica (its manifest arrived, last)
        is renamed to its generation's name; everything else goes but the newest pushed one
        still arriving (a failed push is retried under a new name: none pile up in RAM)."""
        if not self.is_leader or self.nodes == 1:
            return
        complete = _received(self.replica_root)
        keep: set[str] = set()
        floor = -1
        if complete:
            newest, directory = complete[0]
            final = os.path.join(self.replica_root, newest)
            if directory != newest:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(os.path.join(self.replica_root, directory), final)
            keep.add(newest)
            floor = parse_generation(newest) or 0
        arriving = [(_generation_of(n), _mtime(os.path.join(self.replica_root, n)), n)
                    for n in _listdir(self.replica_root) if n.startswith(PENDING_PREFIX)]
        arriving = [a for a in arriving if a[0] is not None and a[0] > floor]
        if arriving:
            keep.add(max(arriving)[2])
        for name in _listdir(self.replica_root):
            if name not in keep and _generation_of(name) is not None:
                shutil.rmtree(os.path.join(self.replica_root, name), ignore_errors=True)

    def drop_newer_replicas(self, generation: str | None) -> None:
        """Leaders after restore: replicas newer than the generation resumed from belong to a
        timeline the job will overwrite."""
        remove_newer(self.replica_root, generation, _generation_of)
        self._pushed = None

    # ---- restore (all ranks) ---------------------------------------------------------------
    def holdings(self) -> tuple[Inventory, Manifests]:
        """A leader's inventory (``memory/routes.py``): its newest in-memory generations and
        replicas, with the files each holds; and the manifests they name."""
        return inventory({"memory": [(n, n) for n in self._committed()],
                          "replica": _received(self.replica_root)},
                         {"memory": self.tier.root, "replica": self.replica_root})

    def _holdings_or_none(self) -> tuple[Inventory | None, Manifests]:
        """This leader's holdings; None (it holds nothing usable) when reading them failed:
        a leader that raised here would leave its peers in the gather."""
        try:
            return self.holdings()
        except Exception:  # noqa: BLE001 - logged; the routes then leave this node out
            log.exception("memory tier: this node's holdings could not be read")
            return None, {}

    def repair(self) -> None:
        """Complete every node's memory copy of the newest generation the nodes can complete,
        and give each node the other nodes' shard files its load reads (collective, one
        routed exchange). No-op on one node.

        Call order: every rank gathers its leader's inventory to rank 0 (manifests named by
        digest: O(W) bytes reach rank 0, O(1) leave any other rank); rank 0 broadcasts the
        manifests it lacks and every rank joins the gather of their texts, each sent by one
        holder (skipped when rank 0 holds them all, the usual case); rank 0 routes and
        broadcasts the routes to the leaders only (on their restore group), which run the
        exchange and gather their failures to rank 0 there."""
        if self.nodes == 1:
            return
        own, manifests = self._holdings_or_none() if self.is_leader else (None, {})
        gathered = self.comm.gather(own)
        held: dict[int, Inventory] = {}
        wanted: dict[str, int] = {}
        if self.comm.rank == 0:
            assert gathered is not None
            held = {rank: h for rank, h in enumerate(gathered) if h is not None}
            wanted = wanted_manifests(held, manifests)
        wanted = self.comm.broadcast(wanted)
        if wanted:  # rank 0's node holds none of some candidate: its text from one holder
            mine = {d: manifests[d] for d, holder in wanted.items()
                    if holder == self.comm.rank and d in manifests}
            for part in self.comm.gather(mine) or []:
                manifests.update(part)
        if not self.is_leader:
            return
        routes: ExchangeRoutes | None = None
        if self.comm.rank == 0:
            try:
                members = {leader: self._members(leader) for leader in self.leaders}
                routes = route_exchange(held, manifests, self.leaders, members, self.comm.world_size)
            except Exception:  # noqa: BLE001 - no routes: restore reads what each node holds
                log.exception("memory tier: the restore exchange could not be routed")
        assert self.channel is not None
        routes = self.comm.broadcast(routes, group=self.channel.group)
        if routes is not None:
            self._run_exchange(routes)

    def _run_exchange(self, routes: ExchangeRoutes) -> None:
        """Leaders: this node's part of the routed exchange; the failures to rank 0."""
        assert self.channel is not None
        outcome = Outcome()
        try:
            outcome = run_exchange(routes, self.channel, self.comm.rank,
                                   Places(self.tier.root, self.replica_root, self.fetched_dir))
        except Exception as exc:  # noqa: BLE001 - every leader must reach the gather below
            log.exception("memory tier: this node's part of the restore exchange failed")
            outcome = Outcome(failures=[f"rank {self.comm.rank}: {type(exc).__name__}: {exc}"])
        self.fetched += len(outcome.received)
        gathered = self.comm.gather(outcome.failures, group=self.channel.group)
        if self.comm.rank != 0:
            return
        self.repair_failures = failures = [f for failed in gathered or [] for f in failed]
        receivers = {t.destination for t in routes.transfers}
        log.info("memory tier: %s completed on %d node(s) from peers (%d file(s))%s", routes.generation,
                 len(receivers), len(routes.transfers),
                 f"; failed: {'; '.join(failures)}" if failures else "")

    def fetch_for_load(self, generation: str, manifest: Manifest, path: str) -> str | None:
        """A local path holding another node's shard file ``path`` of ``generation``, as the
        restore exchange left it; None when it did not (the load reports the file missing)."""
        if self.nodes == 1:
            return None
        target = os.path.join(self.fetched_dir, generation, path)
        if not os.path.exists(target):
            return None
        self.fetched_for_load.append(path)
        return target

    def after_restore(self) -> None:
        shutil.rmtree(self.fetched_dir, ignore_errors=True)

    def close(self, after_error: bool = False) -> None:
        """Every rank, after the manager's pruning thread ended (this node's pushes are over).
        A leader says so in the store, then keeps receiving until its predecessor said the
        same (bounded): the last push of a run is not cut off by the receiver closing first.
        ``after_error``: the job is failing (a peer may be gone): no push, no wait."""
        if not after_error:
            self.push_newest()  # the run's last generation, if the pruning thread had not sent it yet
        if self.receiver is not None:
            if not after_error:
                try:
                    self.comm.store_set(f"ring/pushed/{self.comm.rank}", b"1")
                    self.comm.store_wait([f"ring/pushed/{self.predecessor}"], CLOSE_WAIT_S)
                except Exception:  # noqa: BLE001 - a store gone with rank 0: close at once
                    log.warning("ring close handshake skipped", exc_info=True)
            if not self.receiver.close(CLOSE_WAIT_S if not after_error else 1.0):
                log.warning("the ring's receiver is still receiving at close")
        self.after_restore()


def ring_floor(records: dict[int, str]) -> dict[int, str]:
    """The two lowest replica records (sender leader -> generation): enough for every leader
    to know the lowest of the others' (``others_lowest``), in O(1) bytes."""
    lowest = sorted((parse_generation(g) or 0, leader, g) for leader, g in records.items())[:2]
    return {leader: g for _, leader, g in lowest}


def others_lowest(floor: dict[int, str], leader: int) -> list[str]:
    """The lowest replica record of a node other than ``leader``'s, from ``ring_floor``'s two."""
    others = sorted((parse_generation(g) or 0, g) for sender, g in floor.items() if sender != leader)
    return [others[0][1]] if others else []


def keep_for_rebuild(committed: list[str], replicas: Iterable[str]) -> frozenset[str]:
    """Which of this node's own committed generations (``committed``, newest first) to keep
    so that any other node can be rebuilt: a lost node X is rebuilt at the generation of
    its newest replica (``replicas``: one per other node, as its successor recorded it),
    from that replica and every other node's own copy of that generation. So this node keeps
    every generation from the oldest of those on; a newer one too, as a replica of it may
    be arriving and the record lags the arrival. Always the ``RING_KEEP`` newest (a first
    replica may be arriving); never more than ``RING_KEEP_MAX``, the oldest needed among them.
    """
    numbers = [n for n in (parse_generation(g) for g in replicas) if n is not None]
    keep = committed[:RING_KEEP]
    if numbers:
        floor = min(numbers)
        needed = [g for g in committed if (parse_generation(g) or 0) >= floor]
        if len(needed) > RING_KEEP_MAX:
            needed = [*needed[:RING_KEEP_MAX - 1], needed[-1]]
        keep = [*keep, *needed]
    return frozenset(keep)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _generation_of(name: str) -> int | None:
    """The generation a replica directory holds: ``G`` or a pending ``.pending-G-<id>``."""
    return pending_update(name) if name.startswith(PENDING_PREFIX) else parse_generation(name)


def _received(root: str) -> list[tuple[str, str]]:
    """(generation, directory) of complete replicas (their manifest arrived, last), newest
    first; a pending directory before a published one of the same generation."""
    found = []
    for name in _listdir(root):
        number = _generation_of(name)
        if number is not None and os.path.exists(os.path.join(root, name, MANIFEST_NAME)):
            found.append((number, name.startswith(PENDING_PREFIX), name))
    found.sort(reverse=True)
    return [(generation_name(number), name) for number, _, name in found]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
