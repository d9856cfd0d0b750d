"""Local retention on a node without rank 0 must keep what rank 0's mirror queue still needs."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dist_ckpt.protocol.comm import Comm
from dist_ckpt.protocol.messages import ReplayAnnouncement
from dist_ckpt.replay.replayer import Replayer
from dist_ckpt.tiers.rename import RenameTier


def test_followers_see_rank0_queue_as_pinned(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    release = threading.Event()
    started = {0: threading.Event(), 1: threading.Event()}

    def blocked_replicate(self: Replayer, announce: ReplayAnnouncement, manifest_raw: bytes | None) -> None:
        if announce.generation == "gen-000000000001":
            started[self.comm.rank].set()
            assert release.wait(30)

    monkeypatch.setattr(Replayer, "_replicate", blocked_replicate)
    rank0, rank1 = Comm(), Comm()
    rank1.store = rank0.store  # one c10d store, two ranks
    rank1.node = rank0.node  # and one node: rank 1 sees the bell rank 0 rings
    for rank, comm in enumerate((rank0, rank1)):
        comm.rank, comm.world_size = rank, 2
    local = RenameTier(str(tmp_path))
    mirror = SimpleNamespace(url="memory://mirror")
    uploaders = [Replayer(comm, local, mirror, queue_length=2,  # type: ignore[arg-type]
                          timeout_s=30, channel="mirror") for comm in (rank0, rank1)]
    try:
        uploaders[0].enqueue("gen-000000000001", b"{}")
        assert started[0].wait(30) and started[1].wait(30)  # both ranks are uploading gen 1
        for update in (2, 3):  # queued behind it on rank 0
            uploaders[0].enqueue(f"gen-{update:012d}", b"{}")
        expected = {"gen-000000000001", "gen-000000000002", "gen-000000000003"}
        assert uploaders[0].pending() == expected
        assert uploaders[1].pending() == expected  # rank 1 queues nothing itself
    finally:
        release.set()
        for uploader in uploaders:
            uploader.close(30)
    assert not any(u._thread.is_alive() for u in uploaders)
    assert uploaders[1].pending() == set()  # everything settled: nothing pinned any more
