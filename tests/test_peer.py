"""The memory tier's peer channel (``protocol/peer.py``): a node leader's files served to the
other nodes, and pushes into its replica root only."""

from __future__ import annotations

import os

import pytest

from dist_ckpt.memory.peer import PeerError, PeerFiles, fetch, push

TOKEN = "t" * 32


@pytest.fixture
def server(tmp_path):
    memory, replica = tmp_path / "memory", tmp_path / "replica"
    (memory / "gen-000000000001" / "dcp").mkdir(parents=True)
    (memory / "gen-000000000001" / "dcp" / "__0_0.distcp").write_bytes(b"shard" * 1000)
    (tmp_path / "secret").write_bytes(b"outside the roots")
    replica.mkdir()
    files = PeerFiles({"memory": str(memory), "replica": str(replica)}, TOKEN, "127.0.0.1",
                      writable=frozenset({"replica"}), max_put_bytes=1 << 20)
    address = files.start()
    yield files, address, tmp_path
    files.close()


def test_a_file_is_fetched_whole_and_counted(server) -> None:
    files, address, tmp_path = server
    target = str(tmp_path / "out" / "shard")
    assert fetch(address, TOKEN, "memory", "gen-000000000001/dcp/__0_0.distcp", target,
                 max_bytes=1 << 20) == 5000
    assert open(target, "rb").read() == b"shard" * 1000
    assert files.served == 1


@pytest.mark.parametrize("token, root, path, why", [
    ("x" * 32, "memory", "gen-000000000001/dcp/__0_0.distcp", "bad token"),
    (TOKEN, "memory", "../secret", "unsafe file name"),
    (TOKEN, "memory", "/etc/passwd", "unsafe file name"),
    (TOKEN, "elsewhere", "secret", "no root"),
    (TOKEN, "memory", "gen-000000000001/missing", "No such file"),
])
def test_refused_requests_leave_no_file(server, token, root, path, why) -> None:
    files, address, tmp_path = server
    target = str(tmp_path / "out")
    with pytest.raises(PeerError, match=why):
        fetch(address, token, root, path, target, max_bytes=1 << 20)
    assert not os.path.exists(target)
    assert files.served == 0


def test_a_file_larger_than_the_manifest_says_is_refused(server) -> None:
    _, address, tmp_path = server
    with pytest.raises(PeerError, match="more than the 100 expected"):
        fetch(address, TOKEN, "memory", "gen-000000000001/dcp/__0_0.distcp", str(tmp_path / "out"),
              max_bytes=100)
    assert not os.path.exists(tmp_path / "out")


def test_pushes_create_new_files_in_the_writable_root_only(server) -> None:
    _, address, tmp_path = server
    source = tmp_path / "mine"
    source.write_bytes(b"replica bytes")
    assert push(address, TOKEN, "replica", ".pending-gen-000000000002-ab/dcp/__1_0.distcp", str(source)) == 13
    pushed = tmp_path / "replica" / ".pending-gen-000000000002-ab" / "dcp" / "__1_0.distcp"
    assert pushed.read_bytes() == b"replica bytes"
    with pytest.raises(PeerError, match="__1_0.distcp exists"):  # never over an existing name
        push(address, TOKEN, "replica", ".pending-gen-000000000002-ab/dcp/__1_0.distcp", str(source))
    with pytest.raises(PeerError, match="not writable"):
        push(address, TOKEN, "memory", "gen-000000000001/dcp/__9_0.distcp", str(source))
    with pytest.raises(PeerError, match="unsafe file name"):
        push(address, TOKEN, "replica", "../escaped", str(source))
    assert not (tmp_path / "escaped").exists()
    assert pushed.read_bytes() == b"replica bytes"
    assert not (tmp_path / "memory" / "gen-000000000001" / "dcp" / "__9_0.distcp").exists()


def test_a_push_over_the_size_bound_is_refused(server) -> None:
    _, address, tmp_path = server
    big = tmp_path / "big"
    big.write_bytes(b"\0" * ((1 << 20) + 1))
    # the refusal comes before the body is read: its reason, or a reset if the refusal's
    # close reaches the sender first (TCP discards the reason then)
    with pytest.raises(PeerError, match="bad size|cannot push"):
        push(address, TOKEN, "replica", "big", str(big))
    assert not (tmp_path / "replica" / "big").exists()
