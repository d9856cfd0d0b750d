"""The memory tier across nodes: a ring of replicas, and in-memory restores that fetch from peers.

Each node's memory holds the manifest and that node's ranks' files of an in-memory generation.
A restore from memory then needs, on every node, the generation's common files (DCP
``.metadata``, the global train state: rank 0's node wrote them) and now and then a shard of
another node (DCP writes a replicated tensor, such as an optimizer step count, once, in one
rank's file). With ``memory_replica``, each node's leader also keeps a copy of its ring
predecessor's files of the newest in-memory generation (``<memory root>.replica/G/``), so a
node that lost its memory (a replaced machine, a launcher that died) is rebuilt from it.

Call order:
- ``NodeRing(...)`` on every rank, once, after the filesystem groups are known (collective:
  rank 0 draws the token; the leaders' server addresses are all-gathered);
- ``push_newest`` then ``settle_replicas`` on each leader in the manager's pruning thread
  after each committed save, before the memory prune (so the generation being sent is never
  deleted meanwhile): this node's files of its newest committed in-memory generation go to
  the ring successor, manifest last (a replica's commit point), and the leader counts it in
  the store (one counter per generation); received replicas are renamed to their
  generation's name and older ones dropped;
- ``protected`` in the memory prune (leaders): this node keeps its own copy of the newest
  generation every leader has counted as replicated (and the newer ones), at most
  ``RING_KEEP``. Without it, a node that lost its memory while its newest replica was still
  on the way would leave no generation whole: its successor holds its previous one, and
  every other node already deleted theirs;
- ``repair()`` on every rank at the start of ``restore()`` (collective): every leader's
  holdings are all-gathered, the newest generation the nodes can complete is chosen (the
  same plan on every rank), and each leader fetches what its node lacks into its memory copy.
  Nothing fetched is trusted: selection and the load check sizes and digests as always;
- ``fetch_for_load`` from the memory tier's reader while DCP loads (any rank): a shard file
  this node does not hold, fetched from the node of the rank that wrote it;
- ``after_restore`` (every rank; leaders also ``drop_newer_replicas``), and ``close`` on every
  rank when the manager closes: the last push, then a store handshake so that a leader keeps
  serving until its predecessor's last push is in.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import threading
import uuid

from .. import faults, logs
from ..errors import ConfigError, DistCkptError, ValidationError
from ..format.manifest import (
    COMMON_FILES,
    MANIFEST_NAME,
    PENDING_PREFIX,
    Manifest,
    check_generation_name,
    generation_name,
    parse_generation,
    pending_dir_name,
    pending_update,
)
from ..format.signing import SIGNATURE_NAME
from ..format.validate import check_entry, list_generations
from ..protocol.comm import Comm
from ..storage.local import file_digest, fsync_dir, write_durable
from .peer import PeerError, PeerFiles, fetch, push
from .tier import MemoryTier, remove_newer

log = logs.get(__name__)
PEER_HOST_ENV = "DIST_CKPT_PEER_HOST"
HELD = 2  # newest generations per root a leader reports at restore
RING_KEEP = 2  # own committed in-memory generations a leader keeps for the ring at most
REPLICATED_KEY = "ring/replicated/"  # + generation: how many leaders replicated it
CLOSE_WAIT_S = 30.0  # how long a closing leader keeps serving its predecessor's last push


def peer_host(one_host: bool) -> str:
    """The address this node's server listens on: ``DIST_CKPT_PEER_HOST``; else loopback when
    every rank runs on this host; else the local address of the route to ``MASTER_ADDR`` (a
    name's own address is often a loopback alias, 127.0.1.1, that other nodes cannot reach)."""
    if os.environ.get(PEER_HOST_ENV):
        return os.environ[PEER_HOST_ENV]
    if one_host:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((os.environ.get("MASTER_ADDR") or socket.gethostname(), 1))  # sends nothing
        address = probe.getsockname()[0]
    if address.startswith("127."):
        raise ConfigError(f"the memory tier's peer address on {socket.gethostname()} is {address}, "
                          f"which other nodes cannot reach: set {PEER_HOST_ENV}")
    return address


class NodeRing:
    def __init__(self, comm: Comm, tier: MemoryTier, *, replicate: bool) -> None:
        self.comm = comm
        self.tier = tier
        self.replica_root = tier.root.rstrip("/") + ".replica"
        self.leader_of = comm.all_gather(comm.fs_leader)  # rank -> its node's leader
        self.leaders = sorted(set(self.leader_of))
        self.is_leader = comm.rank == comm.fs_leader
        self.nodes = len(self.leaders)
        self.replicating = replicate and self.nodes > 1
        self.server: PeerFiles | None = None
        self.token = ""
        self.addresses: dict[int, tuple[str, int]] = {}
        if self.nodes > 1:  # the same on every rank: one node needs no server, no collective
            self._start_servers()
        position = self.leaders.index(comm.fs_leader)
        self.successor = self.leaders[(position + 1) % self.nodes]  # holds this node's replica
        self.predecessor = self.leaders[position - 1]  # whose replica this node holds
        self._pushed: str | None = None
        self.fetched = 0  # files this rank fetched from peers for a restore (logs, tests)
        self.repair_failures: list[str] = []  # why a node's copy could not be completed
        self.fetched_for_load: list[str] = []  # other nodes' shard files this rank's loads read
        self.push_lock = threading.Lock()
        self.fetched_dir = tier.root.rstrip("/") + ".fetched"  # shards of other nodes, per load

    def _start_servers(self) -> None:
        """All ranks (collective): rank 0 draws the token; each leader starts its server; the
        addresses are all-gathered, and a server that failed to start fails every rank."""
        comm = self.comm
        self.token = comm.broadcast(secrets.token_hex(16) if comm.rank == 0 else None)
        one_host = len(set(comm.all_gather(socket.gethostname()))) == 1
        started: tuple[str, int] | str | None = None
        if self.is_leader:
            try:  # every rank reaches the all-gather below, whatever fails here
                os.makedirs(self.replica_root, exist_ok=True)
                self.server = PeerFiles({"memory": self.tier.root, "replica": self.replica_root},
                                        self.token, peer_host(one_host), writable=frozenset({"replica"}))
                started = self.server.start()
            except (OSError, ConfigError) as exc:
                started = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
        gathered = comm.all_gather(started)
        failed = [g for g in gathered if isinstance(g, str)]
        if failed:
            if self.server is not None:
                self.server.close()
            raise ConfigError(f"memory tier peer servers did not start: {'; '.join(failed)}")
        self.addresses = {r: tuple(a) for r, a in enumerate(gathered) if a is not None}

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
        if not self.replicating or not self.is_leader:
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
            for path in [*paths, MANIFEST_NAME]:  # the manifest last: a replica's commit point
                push(self.addresses[self.successor], self.token, "replica", f"{target}/{path}",
                     os.path.join(directory, path))
            self._pushed = newest
        except (OSError, DistCkptError) as exc:  # a missed replica costs a restore from the root
            log.warning("no replica of %s on the node of rank %d: %s", newest, self.successor, exc)
            return
        try:
            self.comm.store.add(f"{REPLICATED_KEY}{newest}", 1)
        except Exception:  # noqa: BLE001 - uncounted: the peers keep more, never less
            log.warning("could not count the replica of %s", newest, exc_info=True)

    def protected(self) -> frozenset[str]:
        """Leaders (pruning or persistence thread, in the memory prune): this node's own
        committed generations to keep for a node lost meanwhile. A lost node is rebuilt at the
        newest generation its successor holds whole, which is at least the newest one every
        leader counted as replicated: this node keeps that one and the newer ones (all of its
        ``RING_KEEP`` newest while none is counted by every leader). A replication that lags
        further leaves a lost node to the persistent root. Two store reads at most."""
        if not self.replicating or not self.is_leader:
            return frozenset()
        committed = self._committed()[:RING_KEEP]
        try:
            for index, name in enumerate(committed):
                if self.comm.store.add(f"{REPLICATED_KEY}{name}", 0) >= self.nodes:
                    return frozenset(committed[:index + 1])
        except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): keep them all
            log.warning("could not read the ring's replica counts from the store", exc_info=True)
        return frozenset(committed)

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
    def holdings(self) -> dict:
        """A leader's newest in-memory generations and replicas: per root, generation ->
        (manifest, files held, directory name)."""
        held: dict[str, dict[str, tuple[str, list[str], str]]] = {}
        for root_name, root in (("memory", self.tier.root), ("replica", self.replica_root)):
            found = [(n, n) for n in self._committed()] if root_name == "memory" else _received(root)
            held[root_name] = {}
            for name, directory in found:
                if name in held[root_name]:
                    continue
                path = os.path.join(root, directory)
                try:
                    with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as handle:
                        raw = handle.read()
                except (OSError, UnicodeDecodeError):
                    continue
                held[root_name][name] = (raw, _files_below(path), directory)
                if len(held[root_name]) == HELD:
                    break
        return held

    def repair(self) -> None:
        """Complete every node's memory copy of the newest generation the nodes can complete
        (collective). No-op on one node."""
        if self.nodes == 1:
            return
        gathered = self.comm.all_gather(self.holdings() if self.is_leader else None)
        held = {rank: h for rank, h in enumerate(gathered) if h is not None}
        plan = self._plan(held)
        if plan is None:
            return
        generation, manifest_raw, fetches = plan
        outcome = None
        if self.is_leader and fetches.get(self.comm.rank):
            outcome = self._apply(generation, manifest_raw, fetches[self.comm.rank])
        outcomes = [o for o in self.comm.all_gather(outcome) if o]
        self.repair_failures = outcomes
        if self.comm.rank == 0:
            fetched = sum(len(f) for f in fetches.values())
            log.info("memory tier: %s completed on %d node(s) from peers (%d file(s))%s", generation,
                     sum(1 for f in fetches.values() if f), fetched,
                     f"; failed: {'; '.join(outcomes)}" if outcomes else "")

    def _plan(self, held: dict[int, dict]) -> tuple[str, str, dict[int, list[tuple[str, int, str]]]] | None:
        """The same on every rank: (generation, manifest, per leader [(path, source leader,
        source root)]) for the newest generation every node can complete; None when nothing
        needs fetching or nothing can be completed."""
        names = {n for h in held.values() for root in h.values() for n in root}
        for name in sorted(names, key=parse_generation, reverse=True):
            copies = [(rank, root, h[root][name]) for rank, h in sorted(held.items())
                      for root in ("memory", "replica") if name in h[root]]
            manifest_raw = copies[0][2][0]
            try:
                manifest = Manifest.from_bytes(manifest_raw.encode(), generation=name)
            except Exception:  # noqa: BLE001 - a damaged copy: the next generation
                continue
            if manifest.world_size != self.comm.world_size:
                continue  # selection rejects it with its reason
            sources = [(rank, f"{root}/{directory}", set(files))
                       for rank, root, (raw, files, directory) in copies if raw == manifest_raw]
            fetches: dict[int, list[tuple[str, int, str]]] = {}
            complete = True
            for leader in self.leaders:
                ranks = self._members(leader)
                mine = held.get(leader, {}).get("memory", {}).get(name)
                if mine is not None and mine[0] != manifest_raw:
                    complete = False  # another timeline's copy of that name: never mixed
                    break
                have = set(mine[1]) if mine is not None else set()
                needed = {f.path for f in manifest.files if f.rank in ranks or f.path in COMMON_FILES}
                if 0 in ranks and any(SIGNATURE_NAME in files for _, _, files in sources):
                    needed.add(SIGNATURE_NAME)
                for path in sorted(needed - have):
                    source = next(((r, where) for r, where, files in sources
                                   if path in files and (r, where) != (leader, f"memory/{name}")), None)
                    if source is None:
                        complete = False
                        break
                    fetches.setdefault(leader, []).append((path, *source))
                if not complete:
                    break
            if complete:
                return (name, manifest_raw, fetches) if fetches else None
        return None

    def _apply(self, generation: str, manifest_raw: str, fetches: list[tuple[str, int, str]]) -> str | None:
        """Fetch into this node's memory copy; a new copy is renamed into place manifest-last."""
        check_generation_name(generation)
        final = os.path.join(self.tier.root, generation)
        exists = os.path.isdir(final)
        target = final if exists else os.path.join(
            self.tier.root, pending_dir_name(generation, uuid.uuid4().hex[:8]))
        manifest = Manifest.from_bytes(manifest_raw.encode(), generation=generation)
        entries = {f.path: f for f in manifest.files}
        try:
            if exists:
                with open(os.path.join(final, MANIFEST_NAME), encoding="utf-8") as handle:
                    if handle.read() != manifest_raw:
                        raise PeerError(f"{generation} here has another manifest: left as it is")
            for path, source, where in fetches:
                temporary = os.path.join(target, path + f".fetch-{uuid.uuid4().hex[:8]}")
                root, _, directory = where.partition("/")
                entry = entries.get(path)
                fetch(self.addresses[source], self.token, root, f"{directory}/{path}", temporary,
                      max_bytes=entry.size if entry else 1 << 20, exact=entry is not None)
                try:
                    if entry is not None:
                        try:
                            check_entry(generation, path, entry, *file_digest(temporary, entry.algorithm))
                        except ValidationError as exc:
                            raise PeerError(f"{path} from the node of rank {source} fails its digest: "
                                            f"{exc}") from exc
                    os.link(temporary, os.path.join(target, path))  # never over an existing file
                finally:
                    os.unlink(temporary)
                self.fetched += 1
            if not exists:
                write_durable(os.path.join(target, MANIFEST_NAME), manifest_raw.encode())
                fsync_dir(target)
                os.rename(target, final)
            fsync_dir(self.tier.root)
            return None
        except (OSError, PeerError) as exc:
            if not exists:
                shutil.rmtree(target, ignore_errors=True)
            return f"node of rank {self.comm.rank}: {exc}"

    def fetch_for_load(self, generation: str, manifest: Manifest, path: str) -> str | None:
        """A local path holding ``path`` of ``generation``, fetched from the node of the rank
        that wrote it; None when no node can serve it."""
        entry = next((f for f in manifest.files if f.path == path), None)
        if entry is None or self.nodes == 1 or entry.rank >= len(self.leader_of):
            return None
        target = os.path.join(self.fetched_dir, generation, path)
        if os.path.exists(target):
            return target
        source = self.leader_of[entry.rank]
        temporary = f"{target}.{uuid.uuid4().hex[:8]}"
        try:
            fetch(self.addresses[source], self.token, "memory", f"{generation}/{path}", temporary,
                  max_bytes=entry.size)
            os.replace(temporary, target)
            self.fetched += 1
            self.fetched_for_load.append(path)
        except PeerError as exc:
            log.warning("%s", exc)
            return None
        return target

    def after_restore(self) -> None:
        shutil.rmtree(self.fetched_dir, ignore_errors=True)

    def close(self, after_error: bool = False) -> None:
        """Every rank, after the manager's pruning thread ended (this node's pushes are over).
        A leader says so in the store, then keeps serving until its predecessor said the same
        (bounded): the last push of a run is not cut off by the receiver closing first.
        ``after_error``: the job is failing (a peer may be gone): no push, no wait."""
        if not after_error:
            self.push_newest()  # the run's last generation, if the pruning thread had not sent it yet
        if self.server is not None:
            if not after_error:
                try:
                    self.comm.store_set(f"ring/pushed/{self.comm.rank}", b"1")
                    self.comm.store_wait([f"ring/pushed/{self.predecessor}"], CLOSE_WAIT_S)
                except Exception:  # noqa: BLE001 - a store gone with rank 0: close at once
                    log.warning("ring close handshake skipped", exc_info=True)
            self.server.close()
        self.after_restore()


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


def _files_below(directory: str) -> list[str]:
    found = []
    for parent, _dirs, files in os.walk(directory):
        for name in files:
            found.append(os.path.relpath(os.path.join(parent, name), directory))
    return sorted(found)
