"""A checksum-verifying HTTP proxy in front of moto_server, for tests only.

moto stores the ``x-amz-checksum-*`` value a client sends without checking it against the body,
so on its own it cannot show that a damaged upload is refused. This proxy does what AWS S3
and MinIO do: for every PutObject and UploadPart it computes the checksum of the body it
received and answers ``400 BadDigest`` (without forwarding) when it differs from the one sent,
in a header or in an ``aws-chunked`` trailer. It can also damage the next N upload bodies in
flight (one byte flipped), and it records every request, so a test can count what a save sent.

It listens on 127.0.0.1 only, on a free port; every connection has a socket timeout, and
:func:`checksum_proxy` stops it when the test is done.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import crc32c

SOCKET_TIMEOUT_S = 30.0
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length", "te",
               "proxy-connection", "upgrade"}


def _checksum(algorithm: str, data: bytes) -> str:
    if algorithm == "crc32c":
        raw = crc32c.crc32c(data).to_bytes(4, "big")
    elif algorithm == "crc32":
        raw = zlib.crc32(data).to_bytes(4, "big")
    elif algorithm in ("sha256", "sha1"):
        raw = hashlib.new(algorithm, data).digest()
    else:
        raise ValueError(f"unknown checksum algorithm {algorithm}")
    return base64.b64encode(raw).decode()


def decode_aws_chunked(body: bytes) -> tuple[bytes, dict[str, str]]:
    """The payload and trailers of an ``aws-chunked`` body (``<hex size>[;ext]\\r\\n<data>\\r\\n``
    ... ``0\\r\\n<trailer lines>\\r\\n``)."""
    data, trailers, pos = bytearray(), {}, 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";", 1)[0], 16)
        pos = end + 2
        if size == 0:
            break
        data += body[pos:pos + size]
        pos += size + 2
    for line in body[pos:].split(b"\r\n"):
        if b":" in line:
            name, _, value = line.decode().partition(":")
            trailers[name.strip().lower()] = value.strip()
    return bytes(data), trailers


@dataclass
class ProxyState:
    upstream: str  # host:port of moto_server
    verify: bool = True  # False: forward every body as is (moto alone)
    corrupt_next: int = 0  # damage this many upload bodies in flight (one byte flipped)
    corrupt_match: str = ""  # only bodies whose path contains this
    report_checksums: bool = True  # False: strip x-amz-checksum-* from responses (a store without)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path with query)
    rejected: list[str] = field(default_factory=list)  # paths answered 400 BadDigest
    checked: list[tuple[str, str]] = field(default_factory=list)  # (path, algorithm) verified
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_corruption(self, path: str) -> bool:
        with self.lock:
            if self.corrupt_next > 0 and self.corrupt_match in path:
                self.corrupt_next -= 1
                return True
            return False

    def object_gets(self, fragment: str) -> list[str]:
        """GETs of object keys containing ``fragment`` (listings have no key in their path)."""
        with self.lock:
            return [p for m, p in self.requests if m == "GET" and fragment in p.split("?", 1)[0]]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real endpoint
    timeout = SOCKET_TIMEOUT_S
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._relay()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = bytearray()
            while size := int(self.rfile.readline().split(b";", 1)[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(body)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _is_upload(self) -> bool:
        """PutObject or UploadPart: a PUT of an object key with a body (not a copy, not a
        bucket operation)."""
        path = urlsplit(self.path).path
        return (self.command == "PUT" and path.strip("/").count("/") >= 1
                and "x-amz-copy-source" not in self.headers)

    def _mismatch(self, body: bytes) -> str | None:
        """The algorithm whose checksum did not match the body, or None."""
        payload, trailers = body, {}
        if "aws-chunked" in self.headers.get("Content-Encoding", ""):
            payload, trailers = decode_aws_chunked(body)
        sent = {k.lower(): v for k, v in self.headers.items()} | trailers
        for algorithm in ("crc32c", "crc32", "sha256", "sha1"):
            value = sent.get(f"x-amz-checksum-{algorithm}")
            if value is not None:
                self.server.state.checked.append((self.path, algorithm))
                if _checksum(algorithm, payload) != value:
                    return algorithm
        return None

    def _relay(self) -> None:
        state = self.server.state
        body = self._read_body()
        with state.lock:
            state.requests.append((self.command, self.path))
        if self._is_upload():
            if body and state.take_corruption(self.path):
                pos = body.index(b"\r\n") + 2 if "aws-chunked" in self.headers.get("Content-Encoding", "") \
                    else len(body) // 2
                body = body[:pos] + bytes([body[pos] ^ 0xFF]) + body[pos + 1:]
            algorithm = self._mismatch(body) if state.verify else None
            if algorithm is not None:
                with state.lock:
                    state.rejected.append(self.path)
                self._answer(400, [("Content-Type", "application/xml")], _bad_digest(algorithm))
                return
        self._forward(body)

    def _forward(self, body: bytes) -> None:
        host, _, port = self.server.state.upstream.partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=SOCKET_TIMEOUT_S * 2)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_HEADERS:
                    conn.putheader(name, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_HEADERS and (
                self.server.state.report_checksums or not k.lower().startswith("x-amz-checksum-"))]
            if self.command == "HEAD":  # the object's length, and no body
                headers.append(("Content-Length", resp.getheader("Content-Length") or "0"))
            self._answer(resp.status, headers, data, length=self.command != "HEAD")
        finally:
            conn.close()

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes, *,
                length: bool = True) -> None:
        self.send_response_only(status)
        for name, value in headers:
            self.send_header(name, value)
        if length:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _bad_digest(algorithm: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>BadDigest</Code><Message>The '
            f"{algorithm.upper()} you specified did not match the calculated checksum.</Message>"
            "</Error>").encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: ProxyState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state


@dataclass
class ChecksumProxy:
    url: str
    state: ProxyState


@contextmanager
def checksum_proxy(upstream_url: str) -> Iterator[ChecksumProxy]:
    """A proxy in front of ``upstream_url`` (``http://127.0.0.1:PORT``), stopped on exit."""
    state = ProxyState(upstream=urlsplit(upstream_url).netloc)
    server = _Server(state)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name="s3-checksum-proxy", daemon=True)
    thread.start()
    try:
        yield ChecksumProxy(f"http://127.0.0.1:{server.server_address[1]}", state)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(SOCKET_TIMEOUT_S)
