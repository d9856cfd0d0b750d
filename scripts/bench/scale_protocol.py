"""The scale harness's one seam with the project: every call into ``dist_ckpt`` it makes.

``scale.py`` (the machinery: store server, client processes, counting store, fake collectives,
timing, table) imports nothing from ``dist_ckpt``; it calls the functions below, one simulated
rank at a time, each with that rank's ``Comm`` (``make_comm``). Retargeting the harness to
another protocol touches this module only. Retargeted to the node-level protocol (issue 41,
``PROTOCOL``): reports through node leaders (one key per node, blocking waits on connections of
their own, one ``multi_get``),
a small outcome relayed through each node's directory, write results and ``.metadata`` kept
under the cached plan, idle watching by one bell reader per node. On a tree without
``dist_ckpt.protocol.node`` (6afcc1e, the "before" figures) it drives that tree's protocol:
per-rank reports polled by rank 0, the manifest inside the outcome every rank reads,
per-rank idle polling.

What the machinery calls, and what a retarget revisits: ``rank_role``, ``posts_report``,
``make_comm`` (``SimComm``, its ``close``), ``prepare_process``, ``rank_save``, ``after_save``,
``idle_watchers``, ``stop_watchers``, ``restore_setup``, ``rank_restore``; ``PROTOCOL`` and
``SOURCE`` label the output. The case attributes read are listed on ``scale.Case``.

What each function drives (the project's own code, not a copy of it):

- ``rank_save``: the save agreement (``Comm.all_gather_start`` of a real ``SaveFacts``), then
  ``dist_ckpt.save.coordinator.run_save`` with a real ``SaveJob``/``SaveRequest``: the report,
  rank 0's ``commit`` (``collect_reports``, DCP ``.metadata`` built from the reports' pickled
  write results by DCP's ``FileSystemWriter.finish`` on tmpfs, ``build_manifest``,
  ``Manifest.to_bytes``), the outcome, ``_await_outcome``, the node-copy keys.
  Replaced: ``write_rank_files`` returns this rank's prebuilt entries and pickled DCP write
  results (real ``WriteResult`` objects, ``items`` per rank) instead of writing shards; the
  tier's ``Attempt`` (``_SimAttempt``) publishes nothing (no rename, no fsync, no size
  re-check, no ``latest.json``): ``publish`` returns ``manifest.to_bytes()``.
- ``after_save``: ``StoreKeyRetirer.retire`` of the finished job (what ``InFlight.reap``
  does at the next ``save()``).
- ``idle_watchers`` / ``stop_watchers``: every rank's ``PreemptionWatch`` (a launcher notice
  file that never appears), ``Replayer`` followers of the ``persist`` and ``mirror`` channels
  (rank 0's replayer idle, with nothing queued), and each node leader's ring ``Receiver``
  (memory tier, more than one node). Stopping them is the real close: rank 0's replayers post
  the stop announcement the followers read.
- the node (``dist_ckpt.protocol.node``): each rank's real ``Node`` (its layout from the case,
  its directory in /tmp), with two harness changes, neither of which adds, drops or changes
  a store request. The leaders' bell watchers do not run during the saves and the restore:
  each is a thread that looks for a local hint every 50 ms, and 2,048 of them (16,384 ranks)
  took the two cores; ``idle_watchers`` starts them (``Node.watch``) and ``stop_watchers``
  stops them, so their reads (one a second per node, a few more after a commit's hint) are
  counted in the idle figure only, not in a save's requests: at 4,096 ranks a save counted
  about 32,000 requests with them running and 18,500 without, the difference being mostly
  these reads over the several seconds a save takes on this machine.
  And the threads waiting on a node directory (``SharedLook``: the outcome relay, the bell)
  look at most ``LOCAL_LOOK_MAX_S`` apart, not 0.05 s: one process holds hundreds of nodes
  here, each with its own looker; a rank learns its outcome up to that much later (a save's
  wall time, not rank 0's commit time), and those waits, like ``Comm.store_wait``'s polling,
  run inside the machinery's ``blocked()`` (``prepare_process``).
- ``restore_setup`` / ``rank_restore``: the last committed manifest and ``.metadata`` written
  to a tmpfs root with sparse files of the listed sizes; then ``select_generation``
  (digests off: only ``.metadata`` hashed), ``quarantine.move_blocking`` and
  ``agree_before_load``: the restore's own agreement, not DCP's load.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

import dist_ckpt
from dist_ckpt import __version__
from dist_ckpt.format.manifest import (
    DCP_DIR,
    GLOBAL_STATE_FILE,
    MANIFEST_NAME,
    METADATA_FILE,
    Manifest,
    generation_name,
    rank_state_file,
)
from dist_ckpt.lifecycle.preemption import PreemptionWatch
from dist_ckpt.memory.replicas import Receiver
from dist_ckpt.protocol import comm as comm_module
from dist_ckpt.protocol.comm import Comm, PendingGather

try:  # blocking waits on a connection of their own: the protocol after 68ddf1c
    from dist_ckpt.protocol.comm import WaitConnections
except ImportError:  # pragma: no cover - depends on the tree
    WaitConnections = None  # type: ignore[assignment,misc]
from dist_ckpt.protocol.messages import SaveFacts, SpaceFacts
from dist_ckpt.restart import contract
from dist_ckpt.restore import quarantine
from dist_ckpt.restore.loader import agree_before_load, select_generation
from dist_ckpt.save import coordinator
from dist_ckpt.save.coordinator import StoreKeyRetirer, run_save
from dist_ckpt.save.planning import PreparedSave
from dist_ckpt.save.request import ManifestInfo, SaveJob, SaveRequest
from dist_ckpt.tiers.rename import RenameTier

try:  # the replay's home after the refactoring under way; save/replay.py at 6afcc1e
    from dist_ckpt.replay.replayer import Replayer
except ImportError:  # pragma: no cover - depends on the tree
    from dist_ckpt.save.replay import Replayer  # type: ignore[no-redef]
try:  # the node (leader, relay directory, bell) of the protocol under way; none at 6afcc1e
    from dist_ckpt.protocol import node as node_module
    from dist_ckpt.protocol.node import Node, NodeLayout
except ImportError:  # pragma: no cover - depends on the tree
    node_module = None  # type: ignore[assignment]
    Node = NodeLayout = None  # type: ignore[assignment,misc]

PROTOCOL = ("6afcc1e: per-rank reports, manifest in the outcome, per-rank idle polling" if Node is None
            else "node leaders, blocking waits, small outcome, node relay, cached results, "
                 "one bell reader per node")
SOURCE = os.path.dirname(os.path.abspath(dist_ckpt.__file__))  # the tree driven, printed
ITEM_ROWS, ITEM_COLS = 1024, 4096  # each rank's chunk of each state-dict item (bf16)
ITEM_BYTES = ITEM_ROWS * ITEM_COLS * 2
# the longest pause between two looks at a node directory by the threads waiting on it (the
# library's LOCAL_POLL_MAX_S, 0.05 s): one process holds hundreds of nodes here (module docstring)
LOCAL_LOOK_MAX_S = 0.5
STATE_JSON = b'{"rng": {"torch": "0123456789abcdef", "numpy": "0123456789abcdef"}, "extras": {}}'

# per client process (prepare_process): each local rank's report, rank 0's DCP metadata,
# and the last committed generation rank 0 published (restore_setup)
_PREBUILT: dict[int, tuple[list[dict], bytes]] = {}
_STATE: dict[str, Any] = {}


# ---- the roles the machinery splits its figures by -------------------------------------------
def rank_role(case: Any, rank: int) -> str:
    """``rank0``, ``leader`` (a node's lowest rank: its filesystem group's leader) or ``other``."""
    if rank == 0:
        return "rank0"
    return "leader" if rank % case.ranks_per_node == 0 else "other"


def posts_report(case: Any, rank: int) -> bool:
    """Whether ``rank``'s first store write of a save is what rank 0's collection waits for
    (its report): the harness starts rank 0's collection once every such rank wrote. With
    nodes, the ranks that do not lead one (a leader posts its node's key once its members'
    reports are in: that part is inside rank 0's time)."""
    if Node is None:
        return rank != 0
    return rank % case.ranks_per_node != 0


# ---- the simulated rank's Comm -----------------------------------------------------------------
class _Done:
    def __init__(self, value: list[Any]) -> None:
        self.value = value

    def wait(self) -> list[Any]:
        return self.value


class SimComm(Comm):
    """One simulated rank: the real ``Comm`` methods over a ``PrefixStore`` of this rank's own
    store connection, with the collectives handed to the harness's ``collectives`` (which
    moves the objects between processes and counts the bytes gloo would move). Node-local
    disks: each node of ``ranks_per_node`` ranks is one filesystem group led by its lowest
    rank (``probe_shared_root``'s result on node-local roots) with ``Case.node_local``, else
    one group of every rank (a shared root)."""

    def __init__(self, case: Any, rank: int, store: Any, collectives: Any) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, case.world_size
        self.timeout_s = case.commit_timeout_s
        self.distributed = True
        self.group = None
        self.session = case.session
        self.namespace = f"dist_ckpt/{case.session}/"
        self.store = dist.PrefixStore(self.namespace, store)
        self._counting = store
        if WaitConnections is not None:
            self._waits = WaitConnections(self)
        first = rank - rank % case.ranks_per_node if case.node_local else 0
        self.fs_leader = first
        self.fs_group = _fs_group(case, first)
        self.root_group_has_rank0 = first == 0
        self._groups = []
        self.collectives = collectives
        if Node is not None:  # the tree's protocol has nodes: this rank's, its directory in /tmp
            self.fs_groups = case.nodes if case.node_local else 1
            # no bell watcher until a wait on the bell starts it (``idle_watchers``): see the
            # module docstring (the bell)
            self.node = Node(self.store, rank, case.session, _layout(case, rank), watch=False)
        self.retirer = StoreKeyRetirer(self)
        self.finished: list[SaveJob] = []
        self.results_cache: Any = _results_cache()  # what this rank's saves under one plan repeat

    def new_group(self, ranks: list[int], timeout_s: float, backend: str = "gloo") -> Any:
        return None

    def new_wait_connection(self) -> Any:
        """``blocking_wait``'s connection: another client of the server, counted as this rank
        (not through a ``PrefixStore``: torch's Python ``Store`` cannot take a ``wait`` with
        a timeout from one)."""
        return _PrefixedWaits(self.namespace, self._counting.twin())


    def all_gather(self, obj: Any) -> list[Any]:
        return self.collectives.all_gather(self.rank, obj)

    def all_gather_start(self, obj: Any) -> Any:
        frame = (PendingGather.FRAME_BYTES, PendingGather._HEADER.size)
        return _Done(self.collectives.all_gather(self.rank, obj, frame=frame))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.collectives.broadcast(self.rank, obj, src)

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return self.collectives.gather(self.rank, obj, dst)

    def scatter(self, objs: list[Any] | None, src: int = 0) -> Any:
        return self.collectives.scatter(self.rank, objs, src)

    def close(self) -> None:
        if Node is not None:
            self.node.close()


class _PrefixedWaits:
    """``wait(keys, timeout)`` with the keys a ``PrefixStore`` of ``prefix`` would send."""

    def __init__(self, prefix: str, store: Any) -> None:
        self.prefix, self.store = prefix, store

    def wait(self, keys: list[str], timeout: Any) -> None:
        self.store.wait([f"{self.prefix}/{key}" for key in keys], timeout)


def _layout(case: Any, rank: int) -> Any:
    """This rank's ``NodeLayout``; the job-wide tuples are shared by a process's ranks."""
    key = ("layout", case.world_size, case.ranks_per_node)
    if key not in _STATE:
        per = case.ranks_per_node
        _STATE[key] = (tuple(range(0, case.world_size, per)),
                       tuple(r - r % per for r in range(case.world_size)))
    leaders, node_of = _STATE[key]
    leader = rank - rank % case.ranks_per_node
    members = tuple(range(leader, min(leader + case.ranks_per_node, case.world_size)))
    return NodeLayout(leader, members, leaders, node_of)


def _fs_group(case: Any, first: int) -> list[int]:
    """The ranks of the filesystem group led by ``first``: one list per group in a process,
    shared by its ranks (read only). A list of every rank per rank made setup O(W) per rank:
    at 16,384 ranks, 19 s and 4 GB per client process."""
    key = ("fs_group", case.world_size, first)
    if key not in _STATE:
        last = min(first + case.ranks_per_node, case.world_size) if case.node_local else case.world_size
        _STATE[key] = list(range(first, last))
    return _STATE[key]


def _results_cache() -> Any:
    try:  # the node-level protocol keeps write results and .metadata under the cached plan
        from dist_ckpt.save.results_cache import WriteResultsCache
    except ImportError:  # pragma: no cover - 6afcc1e
        return None
    return WriteResultsCache()


def make_comm(case: Any, rank: int, store: Any, collectives: Any) -> Comm:
    """Rank ``rank``'s ``Comm`` over ``store`` (a ``torch.distributed.Store``)."""
    return SimComm(case, rank, store, collectives)


# ---- per client process ----------------------------------------------------------------------
def _item_names(items: int) -> list[str]:
    """Realistic state-dict keys: parameters and their two Adam moments."""
    names = []
    for index in range(items):
        layer, kind = divmod(index, 9)
        param = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")[kind]
        prefix = ("model", "optim.state.model.exp_avg", "optim.state.model.exp_avg_sq")[layer % 3]
        names.append(f"{prefix}.layers.{layer // 3}.{param}.weight")
    return names


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()  # 64 hex, as a blake3 digest


def _prebuilt(case: Any, rank: int, names: list[str]) -> tuple[list[dict], bytes]:
    """What ``write_rank_files`` returns on ``rank``: its file entries and its pickled DCP
    write results (one ``WriteResult`` per item, as DCP's ``FileSystemWriter`` makes them)."""
    import pickle

    shard = f"__{rank}_0.distcp"
    results = [WriteResult(index=MetadataIndex(fqn, torch.Size([rank * ITEM_ROWS, 0]), 0),
                           size_in_bytes=ITEM_BYTES,
                           storage_data=_StorageInfo(shard, index * ITEM_BYTES, ITEM_BYTES))
               for index, fqn in enumerate(names)]
    files = [(f"{DCP_DIR}/{shard}", ITEM_BYTES * len(names)), (rank_state_file(rank), len(STATE_JSON))]
    if rank == 0:
        files.append((GLOBAL_STATE_FILE, len(STATE_JSON)))
    entries = [{"path": path, "size": size, "blake3": _digest(case.session, path), "rank": rank}
               for path, size in files]
    return entries, pickle.dumps(results)


def _global_metadata(case: Any, names: list[str]) -> Metadata:
    """Rank 0's cached DCP metadata: every item sharded by rows over every rank."""
    props = TensorProperties(dtype=torch.bfloat16)
    size = torch.Size([ITEM_ROWS * case.world_size, ITEM_COLS])
    chunks = [ChunkStorageMetadata(offsets=torch.Size([r * ITEM_ROWS, 0]),
                                   sizes=torch.Size([ITEM_ROWS, ITEM_COLS])) for r in range(case.world_size)]
    return Metadata(state_dict_metadata={fqn: TensorStorageMetadata(props, size, list(chunks))
                                         for fqn in names})


def _prebuilt_writer(request: SaveRequest, rank: int, io_threads: int,
                     commit_timeout_s: float | None = None) -> tuple[list[dict], bytes]:
    return _PREBUILT[rank]


def prepare_process(case: Any, ranks: list[int], blocked: Any = contextlib.nullcontext) -> None:
    """Once per client process, before its first save: each local rank's report, rank 0's
    metadata, ``write_rank_files`` replaced by the prebuilt one (no shard is written), and the
    node directory's waits slowed to ``LOCAL_LOOK_MAX_S`` and run inside ``blocked()`` (the
    machinery's context for a rank that blocks; module docstring)."""
    if node_module is not None:
        node_module.LOCAL_POLL_MAX_S = max(node_module.LOCAL_POLL_MAX_S, LOCAL_LOOK_MAX_S)
        looks = node_module.shared_look
        if not isinstance(looks, _BlockedLooks):
            node_module.shared_look = _BlockedLooks(looks, blocked)
    polls = comm_module.poll_until
    if not isinstance(polls, _BlockedPolls):  # Comm.store_wait's polling sleeps
        comm_module.poll_until = _BlockedPolls(polls, blocked)
    names = _item_names(case.items)
    for rank in ranks:
        _PREBUILT[rank] = _prebuilt(case, rank, names)
    if 0 in ranks:
        _STATE["metadata"] = _global_metadata(case, names)
    coordinator.write_rank_files = _prebuilt_writer


class _BlockedLooks:
    """``node.shared_look`` whose ``SharedLook.wait`` runs inside ``blocked()``."""

    def __init__(self, looks: Any, blocked: Any) -> None:
        self.looks, self.blocked = looks, blocked

    def __call__(self, directory: str) -> Any:
        return _BlockedLook(self.looks(directory), self.blocked)


class _BlockedLook:
    def __init__(self, look: Any, blocked: Any) -> None:
        self.look, self.blocked = look, blocked

    def wait(self, ready: Any, deadline: float) -> bool:
        with self.blocked():
            return self.look.wait(ready, deadline)


class _BlockedPolls:
    """``comm.poll_until`` run inside ``blocked()``: a rank polling the store for a key another
    rank of its process sets (a node's copy published by its leader) must not keep a turn."""

    def __init__(self, polls: Any, blocked: Any) -> None:
        self.polls, self.blocked = polls, blocked

    def __call__(self, done: Any, deadline: float, **kwargs: Any) -> bool:
        with self.blocked():
            return self.polls(done, deadline, **kwargs)


# ---- one save --------------------------------------------------------------------------------
class _SimAttempt:
    """The tier's ``Attempt`` without its file I/O (see the module docstring). Rank 0's
    ``local_dir`` is real (tmpfs): ``commit`` writes DCP's ``.metadata`` there."""

    data_dir = ""
    direct_io = False

    def __init__(self, case: Any, generation: str, attempt_id: str, rank: int) -> None:
        self.generation, self.attempt_id = generation, attempt_id
        # node-local disks: the leader of every other node publishes its copy
        self.shared = not case.node_local
        self.local_dir = os.path.join(case.scratch, f"attempt-{rank}-{generation}-{attempt_id}")
        if rank == 0:
            os.makedirs(os.path.join(self.local_dir, DCP_DIR))

    def put_files(self, entries: list[dict]) -> None:
        pass

    def publish(self, manifest: Manifest, signing_key: bytes | None) -> bytes:
        raw = manifest.to_bytes()
        _STATE["published"] = (self.generation, raw, self.local_dir)
        return raw

    def publish_copy(self, manifest_raw: bytes) -> None:
        pass

    def release(self, entries: list[dict], committed: bool) -> None:
        pass

    def abandon(self) -> None:
        shutil.rmtree(self.local_dir, ignore_errors=True)


def _request(comm: SimComm, case: Any, update: int, attempt_id: str) -> SaveRequest:
    from torch.distributed.checkpoint.planner import SavePlan

    name = generation_name(update)
    root = comm.rank == 0
    plan = _STATE.setdefault("plan", SavePlan([]))  # one cached plan: the same object every save
    extra = {} if comm.results_cache is None else {"results": comm.results_cache}
    prepared = PreparedSave(planner=None, plan=plan,  # type: ignore[arg-type]
                            metadata=_STATE["metadata"] if root else None, reused=True, **extra)
    info = ManifestInfo(world_size=case.world_size, components=["model", "optim", "rng", "extras"],
                        contract={}, contract_digest=contract.digest({}),
                        dist_ckpt_version=__version__) if root else None
    return SaveRequest(generation=name, next_update=update, tokens_seen=update * 4096,
                       attempt=_SimAttempt(case, name, attempt_id, comm.rank), prepared=prepared,
                       rank_state=STATE_JSON, global_state=STATE_JSON if root else None, info=info)


def rank_save(comm: SimComm, case: Any, update: int) -> dict[str, Any]:
    """One rank's part of saving ``update``: the agreement, then ``run_save``. Returns ``ok``,
    ``protocol_s`` (from the agreement's end to ``run_save``'s return: on rank 0, its report,
    commit and outcome) and ``error``."""
    facts = SaveFacts(busy=False, errors=(), boundary=True, cached=True,
                      space=SpaceFacts(leader=comm.fs_leader, bytes=ITEM_BYTES * case.items,
                                       free=1 << 44 if comm.rank == comm.fs_leader else None),
                      extras={}, exists=None,
                      attempt_id=uuid.uuid4().hex[:8] if comm.rank == 0 else None)
    gathered = comm.all_gather_start(facts).wait()
    job = SaveJob(_request(comm, case, update, gathered[0].attempt_id))
    started = job.request.started = time.monotonic()
    run_save(job, comm, 1, case.commit_timeout_s)
    elapsed = time.monotonic() - started
    if comm.rank != 0:
        job.manifest_raw = None  # the harness's memory: thousands of ranks live in a few processes
    comm.finished.append(job)
    return {"ok": job.committed, "protocol_s": elapsed,
            "error": None if job.error is None else str(job.error)[:300]}


def after_save(comm: SimComm, case: Any) -> None:
    """Once every rank finished the save: retire the keys this rank set (``InFlight.reap``);
    rank 0 keeps only the last attempt's directory (its ``.metadata``, for the restore)."""
    for job in comm.finished:
        comm.retirer.retire(job)
    comm.finished.clear()
    if comm.rank == 0 and "published" in _STATE:
        keep = _STATE["published"][2]
        for name in os.listdir(case.scratch):
            path = os.path.join(case.scratch, name)
            if name.startswith("attempt-0-") and path != keep:
                shutil.rmtree(path, ignore_errors=True)


# ---- idle -------------------------------------------------------------------------------------
def idle_watchers(comm: SimComm, case: Any) -> list[Any]:
    """Start what polls the store on this rank while no save or restore runs (see the module
    docstring); returns them for ``stop_watchers``."""
    if Node is not None:
        comm.node.watch()  # the leader's bell watcher (a real Comm's runs from its construction)
    idle = os.path.join(case.scratch, "idle")
    source, destination = (RenameTier(os.path.join(idle, part), direct_io=False)
                           for part in ("memory", "root"))
    watchers: list[Any] = [PreemptionWatch(comm, os.path.join(idle, "no-preempt-notice"), 60.0)]
    for channel, chained in (("persist", False), ("mirror", True)):
        watchers.append(Replayer(comm, source, destination, queue_length=2, timeout_s=60.0,
                                 channel=channel, chained=chained))
    nodes = -(-case.world_size // case.ranks_per_node)
    if rank_role(case, comm.rank) != "other" and nodes > 1:
        node = comm.rank // case.ranks_per_node
        predecessor = ((node - 1) % nodes) * case.ranks_per_node
        receiver = Receiver(comm, None, predecessor, os.path.join(idle, f"replica-{comm.rank}"))  # type: ignore[arg-type]
        receiver.start()
        watchers.append(receiver)
    return watchers


def stop_watchers(comm: SimComm, case: Any, watchers: list[Any]) -> None:
    for watcher in watchers:
        if isinstance(watcher, PreemptionWatch):
            watcher.close()
        else:
            watcher.close(10.0)
    _stop_bell_watcher(comm)


def _stop_bell_watcher(comm: SimComm) -> None:
    """The leader's bell watcher, which the idle followers started, stops with them: the saves
    that follow run without any (module docstring: the bell)."""
    node = getattr(comm, "node", None)
    watcher = getattr(node, "_watcher", None)
    if watcher is not None:
        watcher.stop()
        node._watcher = None  # type: ignore[union-attr]


# ---- restore ----------------------------------------------------------------------------------
def restore_setup(case: Any) -> None:
    """Rank 0's process, after the saves: the last committed generation as a restorable tier
    on tmpfs (its manifest, its real ``.metadata``, every other listed file sparse)."""
    generation, raw, local_dir = _STATE["published"]
    manifest = Manifest.model_validate_json(raw)
    gen_dir = os.path.join(case.restore_root, generation)
    for entry in manifest.files:
        path = os.path.join(gen_dir, entry.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if entry.path == METADATA_FILE:
            shutil.copyfile(os.path.join(local_dir, METADATA_FILE), path)
        else:
            with open(path, "wb") as handle:
                handle.truncate(entry.size)
    with open(os.path.join(gen_dir, MANIFEST_NAME), "wb") as handle:
        handle.write(raw)


def rank_restore(comm: SimComm, case: Any) -> dict[str, Any]:
    """One rank's part of a restore's own agreement: select (broadcast listing and manifest,
    all-gather of problems), quarantine, the agreement before DCP's load."""
    tier = RenameTier(case.restore_root, direct_io=False)
    name, _, _, rejected = select_generation(comm, [tier], digests=False)
    if name is None:
        raise RuntimeError(f"the simulated generation did not validate: {rejected}")
    quarantine.move_blocking(comm, tier, rejected, name)
    agree_before_load(comm, tier, name, None)
    return {"generation": name}
