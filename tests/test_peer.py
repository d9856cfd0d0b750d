"""The memory tier's peer channel on torch.distributed (``memory/peer.py``): files between
node leaders as tensors on a process group of their own, checked before they are installed;
the restore exchange's routes (``memory/routes.py``); and no network listener of dist_ckpt's own."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from dist_ckpt.errors import ConfigError
from dist_ckpt.format.manifest import FileEntry, Manifest
from dist_ckpt.memory import peer, replicas
from dist_ckpt.memory.replicas import ring_group_index, ring_groups_needed
from dist_ckpt.memory.ring import peer_device
from dist_ckpt.memory.routes import Copy, Transfer, manifest_digest, route_exchange, wanted_manifests
from dist_ckpt.testing import run_ranks

GEN = "gen-000000000003"
PAYLOAD = bytes(range(256)) * 41  # 10496 bytes: several chunks of the 4 KiB used here


def entry(path: str, data: bytes, rank: int = 0) -> FileEntry:
    return FileEntry(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest(), rank=rank)


def transfers(rank: int, world: int, base: str) -> dict:
    """Rank 0 sends, rank 1 receives, on one channel, in this order: a good file (4 KiB
    chunks), a file whose bytes differ from its entry, an absent file, a file not the size
    its entry says, a file over an existing name, then a good file again (still in step)."""
    from dist_ckpt.protocol.comm import Comm

    peer.CHUNK = 4096
    comm = Comm(timeout_s=60)
    channel = peer.PeerChannel(comm.new_group([0, 1], 60))
    source, target = os.path.join(base, "source"), os.path.join(base, "target")
    good = entry("dcp/a", PAYLOAD)
    cases = [("a", good), ("flipped", entry("dcp/flipped", PAYLOAD)), ("absent", good),
             ("short", good), ("exists", good), ("again", good)]
    outcomes: dict[str, str] = {}
    if rank == 0:
        os.makedirs(source)
        for name, data in (("a", PAYLOAD), ("flipped", PAYLOAD[:-1] + b"\0"), ("short", PAYLOAD[:100]),
                           ("exists", PAYLOAD), ("again", PAYLOAD)):
            Path(source, name).write_bytes(data)
    comm.barrier()
    for name, listed in cases:
        try:
            if rank == 0:
                outcomes[name] = str(channel.send_file(1, os.path.join(source, name), listed))
            else:
                if name == "exists":
                    os.makedirs(target, exist_ok=True)
                    Path(target, name).write_bytes(b"kept")
                size = channel.receive_file(0, os.path.join(target, name), GEN, listed.path, listed)
                outcomes[name] = str(size)
        except peer.PeerError as exc:
            outcomes[name] = f"refused: {exc}"
    comm.barrier()
    comm.close()
    left = sorted(os.listdir(target)) if rank == 1 else []
    return {"outcomes": outcomes, "left": left}


@pytest.mark.processes
def test_files_cross_whole_and_a_refused_one_leaves_nothing_and_keeps_the_pair_in_step(tmp_path) -> None:
    sender, receiver = run_ranks(2, transfers, str(tmp_path), timeout_s=60)
    got = receiver["outcomes"]
    assert got["a"] == got["again"] == str(len(PAYLOAD))
    assert (tmp_path / "target" / "a").read_bytes() == PAYLOAD
    assert (tmp_path / "target" / "again").read_bytes() == PAYLOAD
    assert "fails its digest" in got["flipped"]
    assert "did not send it" in got["absent"] and "refused" in sender["outcomes"]["absent"]
    assert "did not send it" in got["short"] and "not the 10496" in sender["outcomes"]["short"]
    assert "cannot install" in got["exists"]
    assert (tmp_path / "target" / "exists").read_bytes() == b"kept"  # never over an existing file
    assert receiver["left"] == ["a", "again", "exists"]  # no partial file, no refused one


def manifest_of(files: dict[str, int]) -> str:
    entries = [entry(path, b"x" * 4, rank).model_dump(exclude_none=True) for path, rank in files.items()]
    return Manifest.model_validate({
        "format_version": 2, "generation": GEN, "next_update": 3, "tokens_seen": 0, "world_size": 2,
        "components": [], "contract": {}, "contract_digest": "", "torch_version": "",
        "dist_ckpt_version": "", "created_unix": 0, "save_duration_s": 0, "total_bytes": 0,
        "files": entries}).to_bytes().decode()


def copy_of(raw: str, files: list[str], directory: str, shared: list[str] | None = None) -> Copy:
    return Copy(manifest_digest(raw), files, directory, shared or [])


FILES = {"dcp/.metadata": 0, "state/train_state.json": 0, "dcp/__0_0.distcp": 0, "dcp/__1_0.distcp": 1}
MEMBERS = {0: {0}, 1: {1}}


def test_the_routes_complete_a_lost_node_from_its_peers_replica_and_ships_the_shared_shards() -> None:
    raw = manifest_of(FILES)
    texts = {manifest_digest(raw): raw}
    shared = ["dcp/__1_0.distcp"]  # holds an item stored once for every rank
    held = {0: {"memory": {GEN: copy_of(raw, ["dcp/.metadata", "state/train_state.json", "dcp/__0_0.distcp"],
                                     GEN, shared)},
                "replica": {GEN: copy_of(raw, ["dcp/__1_0.distcp"], ".pending-gen-000000000003-ab")}},
            1: {"memory": {}, "replica": {}}}  # node 1 lost its memory
    routes = route_exchange(held, texts, [0, 1], MEMBERS, world_size=2)
    assert routes is not None and routes.generation == GEN and routes.manifest == raw
    assert routes.transfers == [  # node 0's load reads node 1's shared shard: its own replica's copy
        Transfer("dcp/__1_0.distcp", 0, "replica/.pending-gen-000000000003-ab", 0, load_only=True),
        Transfer("dcp/.metadata", 0, f"memory/{GEN}", 1),
        Transfer("dcp/__1_0.distcp", 0, "replica/.pending-gen-000000000003-ab", 1),
        Transfer("state/train_state.json", 0, f"memory/{GEN}", 1),
    ]
    # both nodes whole: node 0 still needs node 1's shared shard for its load, and only that;
    # from its own replica of node 1 (a local copy) rather than across the network
    whole = ["dcp/__1_0.distcp", "dcp/.metadata", "state/train_state.json"]
    held[1] = {"memory": {GEN: copy_of(raw, whole, GEN)}, "replica": {}}
    routes = route_exchange(held, texts, [0, 1], MEMBERS, world_size=2)
    assert routes is not None
    assert routes.transfers == [Transfer("dcp/__1_0.distcp", 0, "replica/.pending-gen-000000000003-ab", 0,
                                         load_only=True)]
    del held[0]["replica"][GEN]
    routes = route_exchange(held, texts, [0, 1], MEMBERS, world_size=2)
    assert routes is not None
    assert routes.transfers == [Transfer("dcp/__1_0.distcp", 1, f"memory/{GEN}", 0, load_only=True)]


def test_the_routes_never_mix_timelines_and_skip_an_incomplete_generation() -> None:
    raw, other = manifest_of(FILES), manifest_of({**FILES, "dcp/__1_1.distcp": 1})
    texts = {manifest_digest(raw): raw, manifest_digest(other): other}
    mine = [path for path, rank in FILES.items() if rank == 0]
    held = {0: {"memory": {GEN: copy_of(raw, mine, GEN)}, "replica": {}},
            1: {"memory": {GEN: copy_of(other, ["dcp/__1_0.distcp"], GEN)}, "replica": {}}}
    assert route_exchange(held, texts, [0, 1], MEMBERS, world_size=2) is None  # another manifest on node 1
    held[1] = {"memory": {}, "replica": {}}  # nobody holds node 1's shard
    assert route_exchange(held, texts, [0, 1], MEMBERS, world_size=2) is None
    assert route_exchange({0: {"memory": {GEN: copy_of(raw, list(FILES), GEN)}}}, texts, [0], {0: {0, 1}},
                          world_size=3) is None  # another world size: selection says why


def test_rank_0_reads_each_manifest_once_and_only_the_ones_it_lacks() -> None:
    """Inventories name manifests by digest: rank 0 asks one holder for a text it lacks, and
    a generation whose text did not come (or does not match its digest) is passed over."""
    raw = manifest_of(FILES)
    whole = copy_of(raw, list(FILES), GEN)
    held = {0: {"memory": {}, "replica": {}}, 1: {"memory": {GEN: whole}, "replica": {}},
            2: {"memory": {GEN: whole}, "replica": {}}}
    assert wanted_manifests(held, {}) == {manifest_digest(raw): 1}  # the lowest holder only
    assert wanted_manifests(held, {manifest_digest(raw): raw}) == {}
    members = {0: {0}, 1: {1}, 2: set()}
    assert route_exchange(held, {}, [0, 1, 2], members, world_size=2) is None
    assert route_exchange(held, {manifest_digest(raw): raw + " "}, [0, 1, 2], members, world_size=2) is None
    routes = route_exchange(held, {manifest_digest(raw): raw}, [0, 1, 2], members, world_size=2)
    assert routes is not None and routes.manifest == raw
    assert {t.destination for t in routes.transfers} == {0}  # node 0 lost its copy


def test_nccl_without_cuda_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peer_device("gloo") == torch.device("cpu")
    with pytest.raises(ConfigError, match="peer_backend='nccl' needs CUDA.*field peer_backend"):
        peer_device("nccl")


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 7])
def test_a_leader_never_sends_and_receives_on_one_ring_group(nodes: int) -> None:
    groups = [ring_group_index(position, nodes) for position in range(nodes)]
    assert max(groups) < ring_groups_needed(nodes)
    assert all(groups[p] != groups[p - 1] for p in range(nodes))  # its send vs its receive


def test_no_module_of_dist_ckpt_opens_a_socket_of_its_own() -> None:
    """The peer channel is torch.distributed: no listener, no connection of dist_ckpt's
    own (testing.py finds a free port for the tests' rendezvous; the object-store client
    is s3fs's)."""
    package = Path(__file__).resolve().parents[1] / "dist_ckpt"
    importing = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n in ("socket", "socketserver", "http.server") for n in names):
                importing.add(str(path.relative_to(package)))
    assert importing == {"testing.py"}


class FakeChannel:
    """Records sends; a receive writes the announced number of bytes."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, int | None]] = []

    def send_file(self, dst: int, path: str, entry: object, size: int | None = None) -> int:
        self.sent.append((dst, os.path.basename(path), size))
        return size or 0

    def receive_file(self, src: int, target: str, generation: str, name: str, entry: object,
                     expected: int | None = None) -> int:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        Path(target).write_bytes(b"r" * (expected or 0))
        return expected or 0


def test_an_offer_nobody_takes_is_withdrawn_and_a_taken_one_is_sent_manifest_last(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dist_ckpt.protocol.comm import Comm

    monkeypatch.setattr(replicas, "OFFER_WAIT_S", 0.05)
    comm, channel = Comm(), FakeChannel()
    (tmp_path / "shard").write_bytes(b"x" * 10)
    (tmp_path / "manifest.json").write_bytes(b"{}")
    sender = replicas.Sender(comm, channel, successor=1, done_wait_s=1)  # type: ignore[arg-type]
    with pytest.raises(peer.PeerError, match="did not take the replica"):
        sender.push(GEN, str(tmp_path), f".pending-{GEN}-ab", ["shard"])
    assert channel.sent == []
    # a receiver that comes late loses the compare-and-set: it never waits for the bytes
    assert comm.store.compare_set("ring/accept/0/0", "", "accepted") == b"withdrawn"
    comm.store.set("ring/accept/0/1", b"accepted")  # the next offer, taken and kept
    comm.store.set("ring/done/0/1", b"ok")
    sender.push(GEN, str(tmp_path), f".pending-{GEN}-cd", ["shard"])
    assert channel.sent == [(1, "shard", 10), (1, "manifest.json", 2)]
    assert not comm.store.check(["ring/accept/0/1"]) and not comm.store.check(["ring/done/0/1"])


def test_a_received_replica_is_counted_and_a_bad_one_leaves_nothing(tmp_path) -> None:
    from dist_ckpt.protocol.comm import Comm

    comm = Comm()
    receiver = replicas.Receiver(comm, FakeChannel(), predecessor=1, replica_root=str(tmp_path))  # type: ignore[arg-type]
    files = [["dcp/__1_0.distcp", 7], ["manifest.json", 2]]
    assert receiver._receive({"generation": GEN, "target": f".pending-{GEN}-ab", "files": files}) == "ok"
    assert (tmp_path / f".pending-{GEN}-ab" / "dcp" / "__1_0.distcp").read_bytes() == b"r" * 7
    assert comm.store.get(f"{replicas.REPLICA_OF_KEY}1") == GEN.encode()
    for target, offered in ((f"../{GEN}", files), (f".pending-{GEN}-cd", [["../escaped", 3], *files])):
        answer = receiver._receive({"generation": GEN, "target": target, "files": offered})
        assert answer.startswith(f"the node of rank 0 kept no replica of {GEN}")
    assert sorted(os.listdir(tmp_path)) == [f".pending-{GEN}-ab"]  # nothing else, no scratch
    assert comm.store.get(f"{replicas.REPLICA_OF_KEY}1") == GEN.encode()


class FlakyStore:
    """A c10d store whose ``check`` fails ``failures`` times, then answers as ``store``."""

    def __init__(self, store: object, failures: int) -> None:
        self.store, self.failures = store, failures

    def check(self, keys: list[str]) -> bool:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("store read failed")
        return self.store.check(keys)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


def test_a_receiver_whose_store_read_failed_takes_the_next_offer(tmp_path, monkeypatch) -> None:
    from dist_ckpt.protocol.comm import Comm

    monkeypatch.setattr(replicas, "RETRY_S", 0.01)
    comm = Comm()
    comm.store = FlakyStore(comm.store, failures=2)  # type: ignore[assignment]
    arrived = threading.Event()
    receiver = replicas.Receiver(comm, FakeChannel(), predecessor=1, replica_root=str(tmp_path),  # type: ignore[arg-type]
                                 on_replica=arrived.set)
    receiver.start()
    try:
        offer = {"generation": GEN, "target": f".pending-{GEN}-ab", "files": [["manifest.json", 2]]}
        comm.store.set("ring/offer/1/0", json.dumps(offer).encode())
        comm.node.ring()  # as a sender does: the receiver looks at the store when it rings
        assert arrived.wait(30), "the receiver stopped after the store failed it"
        assert comm.store.get("ring/done/1/0") == b"ok" and comm.store.failures == 0
    finally:
        assert receiver.close(5)


@pytest.mark.parametrize(("committed", "replicas_of_others", "kept"), [
    # the other nodes' newest replicas are of different generations: keep from the oldest on
    ([9, 8, 7, 6, 5], [7, 9], {9, 8, 7}),
    # none recorded yet (a first replica may be arriving): the two newest
    ([9, 8, 7], [], {9, 8}),
    # replication lagging far behind: the newest ones and the oldest needed, four in all
    ([9, 8, 7, 6, 5, 4, 3], [3], {9, 8, 7, 3}),
])
def test_a_node_keeps_what_rebuilds_any_other_node(committed, replicas_of_others, kept) -> None:
    from dist_ckpt.format.manifest import generation_name
    from dist_ckpt.memory.ring import keep_for_rebuild

    names = [generation_name(n) for n in committed]
    got = keep_for_rebuild(names, [generation_name(n) for n in replicas_of_others])
    assert got == {generation_name(n) for n in kept}


def test_the_inventory_reports_every_generation_a_node_keeps_for_a_rebuild(tmp_path) -> None:
    """A lost node is rebuilt at its newest replica's generation, which can be the oldest a
    peer keeps (``keep_for_rebuild``): the restore exchange's routes must see that copy."""
    from dist_ckpt.format.manifest import generation_name
    from dist_ckpt.memory.ring import RING_KEEP_MAX
    from dist_ckpt.memory.routes import inventory

    names = [generation_name(n) for n in range(9, 9 - RING_KEEP_MAX - 1, -1)]  # newest first
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    held, texts = inventory({"memory": [(n, n) for n in names]}, {"memory": str(tmp_path)})
    assert sorted(held["memory"]) == sorted(names[:RING_KEEP_MAX])
    assert texts == {held["memory"][names[0]].digest: "{}"}  # one text, however many copies name it


def test_the_ring_floor_keeps_for_every_leader_what_all_records_would() -> None:
    """``protected`` reads two records published by the first leader instead of every
    leader's record: for each leader, what it keeps must not change."""
    import random

    from dist_ckpt.format.manifest import generation_name
    from dist_ckpt.memory.ring import keep_for_rebuild, others_lowest, ring_floor

    chance = random.Random(7)
    committed = [generation_name(n) for n in range(20, 0, -1)]
    for _ in range(200):
        leaders = chance.sample(range(64), chance.randint(2, 6))
        records = {leader: generation_name(chance.randint(1, 20)) for leader in leaders
                   if chance.random() < 0.8}
        floor = ring_floor(records)
        assert len(floor) <= 2
        for leader in leaders:
            everyone = [g for sender, g in records.items() if sender != leader]
            assert keep_for_rebuild(committed, others_lowest(floor, leader)) == \
                keep_for_rebuild(committed, everyone)


class CountingStore:
    """A HashStore that counts the requests it is sent, by kind."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.inner = dist.HashStore()
        self.requests: dict[str, int] = {}

    def __getattr__(self, name: str):  # noqa: ANN204 - the store's method, counted
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):  # noqa: ANN202, ANN002, ANN003
            self.requests[name] = self.requests.get(name, 0) + 1
            return method(*args, **kwargs)
        return counted


def test_the_first_leader_reads_all_replica_records_in_one_request_once_they_exist() -> None:
    store = CountingStore()
    records = replicas.ReplicaRecords(store, [0, 8, 16, 24])
    store.set(f"{replicas.REPLICA_OF_KEY}8", b"gen-000000000004")
    assert records.read() == {8: "gen-000000000004"}  # the others: not written yet
    for sender in (0, 16, 24):
        store.set(f"{replicas.REPLICA_OF_KEY}{sender}", b"gen-000000000005")
    records.read()
    store.requests.clear()
    assert records.read() == {8: "gen-000000000004", 0: "gen-000000000005", 16: "gen-000000000005",
                              24: "gen-000000000005"}
    assert store.requests == {"multi_get": 1}  # whatever the number of nodes
