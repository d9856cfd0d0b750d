"""The replays chained in one process: memory -> root (channel ``persist``) -> mirror (channel
``mirror``), each a local directory here (the replay does not ask which kind a tier is). Order,
channel-scoped store keys, ``mirror_every``, pins per tier, retention per tier, and DONE only
once the final generation is in every tier."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dist_ckpt import CheckpointConfig, CheckpointManager, ConfigError, faults
from dist_ckpt.context import Context, Tiers
from dist_ckpt.format.inventory import is_committed
from dist_ckpt.format.manifest import MANIFEST_NAME, generation_name
from dist_ckpt.format.validate import list_generations
from dist_ckpt.lifecycle import retention
from dist_ckpt.lifecycle.finish import done_record
from dist_ckpt.lifecycle.replication import MirrorPolicy, ReplayChain
from dist_ckpt.protocol import gather, messages
from dist_ckpt.protocol.comm import Comm
from dist_ckpt.replay.record import read_mirror_state, read_record
from dist_ckpt.replay.replayer import Replayer
from dist_ckpt.tiers.rename import RenameTier
from tests.helpers.local_jobs import make_state, step

GENS = [generation_name(u) for u in (1, 2, 3, 4)]


@pytest.fixture(autouse=True)
def clean_faults() -> Iterator[None]:
    faults.configure(None)
    yield
    faults.configure(None)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Four committed generations in a local root: the "memory" the chain starts from."""
    root = str(tmp_path_factory.mktemp("memory"))
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        for update in (1, 2, 3, 4):
            step(state)
            mgr.save(update)
    return root


def build_chain(source: str, tmp_path: Path, every: int = 1) -> tuple[Comm, list[RenameTier], ReplayChain]:
    comm = Comm()
    tiers = [RenameTier(source), RenameTier(str(tmp_path / "root")), RenameTier(str(tmp_path / "mirror"))]
    os.makedirs(tiers[1].root, exist_ok=True)
    options = {"queue_length": 8, "timeout_s": 30.0, "nice": 0}
    persist = Replayer(comm, tiers[0], tiers[1], channel="persist", **options)
    mirror = Replayer(comm, tiers[1], tiers[2], channel="mirror", chained=True, **options)
    return comm, tiers, ReplayChain([persist, mirror], MirrorPolicy(every))


def feed(chain: ReplayChain, memory: RenameTier, names: list[str]) -> None:
    for name in names:
        chain.local_committed(name)
        chain.enqueue(name, memory.store.read_bytes(f"{name}/{MANIFEST_NAME}"))


def committed(tier: RenameTier) -> list[str]:
    return sorted(g for g in list_generations(tier.store) if is_committed(tier.store, g))


def test_persisted_generations_reach_the_mirror_under_mirror_every(source: str, tmp_path: Path) -> None:
    _, (memory, root, mirror), chain = build_chain(source, tmp_path, every=2)
    chain.force(GENS[2])  # finish(): the final one goes up whatever mirror_every says
    feed(chain, memory, GENS[:3])
    assert chain.drain(60)
    chain.close(10)
    assert committed(root) == GENS[:3]  # every persisted one
    assert committed(mirror) == [GENS[1], GENS[2]]  # every 2nd, and the forced one
    # each channel records what it completed beside its own source, in a file of its own
    assert read_record(memory.store, "persist")["last_completed"] == GENS[2]
    assert read_record(memory.store, "persist")["root"] == root.url
    assert not os.path.exists(os.path.join(memory.root, "mirror.json"))
    assert read_mirror_state(root.store)["last_completed"] == GENS[2]
    assert read_mirror_state(root.store)["mirror"] == mirror.url
    assert not os.path.exists(os.path.join(root.root, "persist.json"))
    assert chain.stages[0].stats.completed == GENS[:3]
    assert chain.stages[1].stats.completed == [GENS[1], GENS[2]]


def test_channels_have_their_own_store_keys() -> None:
    keys = {messages.replay_seq_key("persist", 1), messages.replay_seq_key("mirror", 1),
            gather.rank_key(messages.replay_scope("persist", 1), 0),
            gather.rank_key(messages.replay_scope("mirror", 1), 0),
            messages.replay_outcome_key("persist", 1), messages.replay_copy_key("persist", 1, 1),
            messages.replay_pinned_key("persist"), messages.replay_pinned_key("mirror")}
    assert len(keys) == 8


def test_each_source_is_pinned_while_its_channel_copies(source: str, tmp_path: Path) -> None:
    """A generation being persisted is pinned in memory; once on the root, while the mirror
    uploads it, it is pinned on the root, and root retention keeps it."""
    comm, (memory, root, mirror), chain = build_chain(source, tmp_path)
    persist, upload = chain.stages
    faults.configure({"persist.upload": {"block": "persist"}, "mirror.upload": {"block": "mirror"}})
    feed(chain, memory, [GENS[0]])
    faults.wait_reached("persist")
    assert persist.pending() == {GENS[0]} and upload.pending() == set()
    assert comm.read_names(messages.replay_pinned_key("persist")) == {GENS[0]}
    assert not os.path.exists(os.path.join(mirror.root, GENS[0]))
    faults.release("persist")
    faults.wait_reached("mirror")
    assert committed(root) == [GENS[0]] and upload.pending() == {GENS[0]}
    assert comm.read_names(messages.replay_pinned_key("mirror")) == {GENS[0]}
    feed(chain, memory, [GENS[1]])
    assert persist.drain(30)  # gen 2 is on the root; the mirror is still busy with gen 1
    retention.prune(root, keep_last=1, pinned=frozenset(upload.pending()))
    assert committed(root) == GENS[:2], "root retention kept what the mirror still uploads"
    faults.release("mirror")
    assert chain.drain(60)
    chain.close(10)
    assert committed(mirror) == GENS[:2]
    retention.prune(root, keep_last=1, pinned=frozenset(upload.pending()))
    assert committed(root) == [GENS[1]]  # each tier its own retention: the root keeps 1 now
    assert committed(memory) == GENS  # the source itself is untouched by the replays


def test_done_only_once_the_final_generation_is_in_every_tier(source: str, tmp_path: Path) -> None:
    _, (memory, root, mirror), chain = build_chain(source, tmp_path)
    config = CheckpointConfig(root=root.root, mirror="s3://bucket/run")
    ctx = Context(chain.head.comm, config, make_state(), Tiers(root=root, target=memory, mirror=mirror))
    faults.configure({"mirror.before_publish": {"raise": True}})
    feed(chain, memory, [GENS[3]])
    record, problem = done_record(ctx, GENS[3], chain)
    assert record is None and problem is not None
    assert problem.startswith("the mirror replay did not complete it"), problem
    assert committed(root) == [GENS[3]] and committed(mirror) == []
    faults.configure(None)
    chain.stages[1].enqueue(GENS[3], root.store.read_bytes(f"{GENS[3]}/{MANIFEST_NAME}"))
    record, problem = done_record(ctx, GENS[3], chain)
    chain.close(10)
    assert problem is None and record is not None and record.generation == GENS[3]
    assert committed(mirror) == [GENS[3]]


def test_mirror_every_is_validated_and_named() -> None:
    with pytest.raises(ConfigError, match="mirror_every=0"):
        CheckpointConfig(root="/tmp/x", mirror="s3://b/p", mirror_every=0)
    assert CheckpointConfig(root="/tmp/x", mirror="s3://b/p", mirror_every=3).mirror_every == 3
    policy = MirrorPolicy(3)
    policy.force("gen-5")
    assert [policy.due(f"gen-{n}") for n in range(1, 8)] == [False, False, True, False, True, True, False]


def test_the_persist_record_of_an_older_memory_directory_is_still_read(tmp_path: Path) -> None:
    """The persist channel once wrote its record as ``mirror.json`` beside its source: read
    where ``persist.json`` is absent, the destination under its own key."""
    (tmp_path / "mirror.json").write_text(json.dumps({"mirror": "/root", "last_completed": GENS[0]}))
    assert read_record(str(tmp_path), "persist") == {"root": "/root", "last_completed": GENS[0]}
    (tmp_path / "persist.json").write_text(json.dumps({"root": "/root", "last_completed": GENS[1]}))
    assert read_record(str(tmp_path), "persist")["last_completed"] == GENS[1]
    with pytest.raises(ValueError, match="no replay channel"):
        read_record(str(tmp_path), "elsewhere")
