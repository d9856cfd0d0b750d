"""Object-store uploads verified by transport checksums instead of a read-back.

Every request goes through a checksum-verifying proxy in front of moto (moto stores the
checksum a client sends without checking it): the proxy refuses a body that does not match
its ``x-amz-checksum-*`` with ``400 BadDigest``, can damage bodies in flight, and records
every request.
"""

from __future__ import annotations

import base64
import http.client
import os
from collections.abc import Iterator
from urllib.parse import urlsplit

import crc32c
import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, DistCkptError
from dist_ckpt.format.validate import read_manifest
from dist_ckpt.storage import checksum
from dist_ckpt.storage.objectstore import ObjectStore
from tests.helpers.local_jobs import make_state, step
from tests.helpers.mirror_runs import remote_states
from tests.helpers.s3 import new_bucket
from tests.helpers.s3proxy import ProxyState, checksum_proxy

GEN1, GEN2 = "gen-000000000001", "gen-000000000002"
NO_RETRY = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}  # a refusal fails at once


@pytest.fixture
def proxy(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProxyState]:
    with checksum_proxy(s3_endpoint) as running:
        monkeypatch.setenv("AWS_ENDPOINT_URL", running.url)  # every client of the test goes through it
        yield running.state


@pytest.fixture
def root(proxy: ProxyState) -> str:
    return f"s3://{new_bucket()}/run"


def save(root: str, updates: tuple[int, ...], **config) -> dict[str, torch.Tensor]:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, **config), state) as mgr:
        for update in updates:
            step(state)
            mgr.save(update)
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def restored(root: str, saved: dict[str, torch.Tensor], expected: str, **config) -> None:
    fresh = make_state()
    with CheckpointManager(CheckpointConfig(root=root, **config), fresh) as mgr:
        assert mgr.restore().generation == expected
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, saved[key])


def uploads(proxy: ProxyState) -> list[str]:
    return [p for m, p in proxy.requests if m == "PUT" and "/attempt-" in p]


@pytest.mark.parametrize("mode", ["checksum", "readback"])
def test_upload_verification_commits_and_restores(root: str, proxy: ProxyState, mode: str) -> None:
    saved = save(root, (1, 2), upload_verification=mode)
    put = uploads(proxy)
    manifest = read_manifest(ObjectStore(root), GEN2)
    assert len([p for p in put if f"/{GEN2}/" in p]) == len(manifest.files)
    if mode == "checksum":
        assert proxy.object_gets("/attempt-") == []  # no object was downloaded again
        checked = {path for path, algorithm in proxy.checked if algorithm == "crc32c"}
        assert set(put) <= checked  # every body carried its CRC32C and the proxy verified it
    else:
        assert len(proxy.object_gets("/attempt-")) >= len(put)  # read back, each at least once
    assert proxy.rejected == []
    restored(root, saved, GEN2, upload_verification=mode)


def test_body_damaged_in_flight_is_refused_and_retried(root: str, proxy: ProxyState) -> None:
    proxy.corrupt_next, proxy.corrupt_match = 1, "/attempt-"
    saved = save(root, (1,))
    assert len(proxy.rejected) == 1  # BadDigest: the damaged body was never stored
    assert proxy.corrupt_next == 0
    restored(root, saved, GEN1)  # botocore sent it again, intact


def test_body_damaged_in_flight_fails_the_save_and_commits_nothing(root: str, proxy: ProxyState) -> None:
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root, storage_options=NO_RETRY), state) as mgr:
        step(state)
        mgr.save(1)
        saved = {k: v.clone() for k, v in state.model.state_dict().items()}
        proxy.corrupt_next, proxy.corrupt_match = 1, f"/{GEN2}/attempt-"
        step(state)
        with pytest.raises(DistCkptError) as failure:
            mgr.save(2)
    message = str(failure.value)
    assert "StorageError" in message and "did not match the calculated checksum" in message
    assert len(proxy.rejected) == 1
    assert remote_states(root).get(GEN2) != "committed"
    backend = ObjectStore(root)
    assert not backend.exists(f"{GEN2}/manifest.json")
    restored(root, saved, GEN1)


def test_store_reporting_no_checksum_falls_back_to_read_back(root: str, proxy: ProxyState) -> None:
    proxy.report_checksums = False  # a store that takes the header but reports nothing on HEAD
    saved = save(root, (1,))
    assert len(proxy.object_gets("/attempt-")) >= len(uploads(proxy))
    restored(root, saved, GEN1)


@pytest.mark.parametrize("digest_algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("mode", ["checksum", "readback"])
def test_mirror_uploads_use_the_configured_verification(root: str, proxy: ProxyState, tmp_path,
                                                        mode: str, digest_algorithm: str) -> None:
    saved = save(str(tmp_path / "local"), (1,), mirror=root, upload_verification=mode,
                 digest_algorithm=digest_algorithm)
    assert remote_states(root) == {GEN1: "committed"}
    assert uploads(proxy)
    assert (proxy.object_gets("/attempt-") == []) == (mode == "checksum")
    restored(root, saved, GEN1)


def _big_file(tmp_path, size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("algorithm", ["CRC32C", "SHA256"])
def test_multipart_upload_sends_part_checksums(root: str, proxy: ProxyState, tmp_path,
                                               algorithm: str) -> None:
    local, data = _big_file(tmp_path, 12 << 20)
    backend = ObjectStore(root)
    backend.part_size, backend.parts_in_flight, backend.checksum_algorithm = 5 << 20, 2, algorithm
    sent = backend.put_file_checksummed(local, "big.bin")
    assert sent.endswith("-3")  # three parts: the composite checksum S3 reports
    parts = [p for p, a in proxy.checked if "partNumber=" in p and a == algorithm.lower()]
    assert len(parts) == 3
    size, stored = backend.head_checksum("big.bin")
    assert size == len(data) and stored is not None and checksum.matches(stored, sent)
    assert proxy.object_gets("big.bin") == []
    assert backend.read_bytes("big.bin") == data


def test_damaged_part_aborts_the_multipart_upload(root: str, proxy: ProxyState, tmp_path) -> None:
    local, _ = _big_file(tmp_path, 12 << 20)
    backend = ObjectStore(root, NO_RETRY)
    backend.part_size = 5 << 20
    proxy.corrupt_next, proxy.corrupt_match = 1, "partNumber=2"
    with pytest.raises(OSError, match="did not match"):
        backend.put_file_checksummed(local, "big.bin")
    assert len(proxy.rejected) == 1
    assert not backend.exists("big.bin")
    bucket = backend.base.split("/")[0]
    assert not backend.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_composite_checksum_matches_the_definition() -> None:
    parts = [b"a" * 10, b"b" * 7]
    raws = [crc32c.crc32c(p).to_bytes(4, "big") for p in parts]
    expected = base64.b64encode(crc32c.crc32c(b"".join(raws)).to_bytes(4, "big")).decode()
    sent = checksum.composite([checksum.raw_checksum(p, "CRC32C") for p in parts], "CRC32C")
    assert sent == f"{expected}-2"


@pytest.mark.parametrize("damaged", [False, True])
def test_proxy_checks_aws_chunked_trailers(root: str, proxy: ProxyState, damaged: bool) -> None:
    """botocore sends a trailer checksum (aws-chunked) over HTTPS when it computes the checksum
    itself; the proxy verifies those too."""
    data = os.urandom(70_000)
    value = base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()
    body = f"{len(data):x}\r\n".encode() + data + f"\r\n0\r\nx-amz-checksum-crc32c:{value}\r\n\r\n".encode()
    proxy.corrupt_next = int(damaged)
    backend = ObjectStore(root)
    url = urlsplit(os.environ["AWS_ENDPOINT_URL"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("PUT", f"/{backend._key('chunked.bin')}", body=body, headers={
            "Content-Encoding": "aws-chunked", "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
            "x-amz-trailer": "x-amz-checksum-crc32c", "x-amz-decoded-content-length": str(len(data))})
        response = conn.getresponse()
        answer = response.read()
    finally:
        conn.close()
    if damaged:
        assert response.status == 400 and b"BadDigest" in answer
        assert not backend.exists("chunked.bin")
    else:
        assert response.status == 200, answer
        assert backend.read_bytes("chunked.bin") == data
