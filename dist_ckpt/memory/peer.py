"""Files of one node served to the other nodes of the job: the memory tier's peer channel.

Each rank that leads a filesystem group (one per node) runs a :class:`PeerFiles` server in a
daemon thread, over TCP on the address other nodes reach it by. A request names a root
(``memory`` or ``replica``) and a relative path below it; the answer is the file's bytes, or,
for a ``put`` into a root the server declared writable, the new file is written (never over an
existing name). Nothing else: no listing, no links followed, no path outside the root. Every
request carries the job's token (rank 0 draws it; every rank learns it in the collective that
exchanges the addresses), so another process on the host cannot read the job's state.

The bytes are not trusted: whoever fetched them checks them against the manifest (sizes and
digests) before anything is loaded, as with any other tier.

Call order: every rank constructs ``PeerFiles`` (only leaders ``start`` it) in the same
collective that exchanges addresses (``memory/ring.py``); ``fetch`` from any thread of any
rank while the server runs; ``close`` once, when the manager closes.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable
from typing import BinaryIO

from .. import logs
from ..errors import DistCkptError
from ..format.manifest import check_relative_path
from ..storage.local import open_regular

log = logs.get(__name__)

MAX_REQUEST = 4096
CHUNK = 8 << 20
_LENGTH = struct.Struct("!q")  # the file's size, or -1 then a length-prefixed reason


class PeerError(DistCkptError):
    """A peer did not serve a file (unreachable, refused, or the file is absent there)."""


class PeerFiles:
    """The server side: ``roots`` maps a root name to a local directory."""

    def __init__(self, roots: dict[str, str], token: str, host: str, *,
                 writable: frozenset[str] = frozenset(), max_put_bytes: int = 1 << 40) -> None:
        self.roots = roots
        self.writable = writable  # roots a peer may push new files into
        self.max_put_bytes = max_put_bytes
        self.token = token
        self.host = host
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.served = 0  # files served: tests and logs
        self.address: tuple[str, int] | None = None

    def start(self) -> tuple[str, int]:
        listener = socket.create_server((self.host, 0))
        listener.settimeout(0.5)  # wakes the accept loop to notice close()
        self._listener = listener
        self.address = (self.host, listener.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, daemon=True, name="dist-ckpt-peer-files")
        self._thread.start()
        return self.address

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), daemon=True,
                             name="dist-ckpt-peer-answer").start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            conn.settimeout(60)
            try:
                request = _read_request(stream)
                path = self._resolve(request)
                if request.get("op") == "put":
                    self._receive(conn, stream, request, path)
                    return
                with open_regular(path) as handle:
                    size = os.fstat(handle.fileno()).st_size
                    conn.sendall(_LENGTH.pack(size))
                    _send_from(conn, handle, size)
                self.served += 1
            except (OSError, ValueError, PeerError, DistCkptError) as exc:
                log.warning("peer request refused: %s: %s", type(exc).__name__, exc)
                reason = f"{type(exc).__name__}: {exc}".encode()[:1024]
                try:
                    conn.sendall(_LENGTH.pack(-1) + struct.pack("!I", len(reason)) + reason)
                except OSError:
                    pass

    def _receive(self, conn: socket.socket, stream: BinaryIO, request: dict, path: str) -> None:
        """A pushed file: only below the writable root, only a new name, at most its size."""
        if request.get("root") not in self.writable:
            raise PeerError(f"root {request.get('root')!r} is not writable")
        size = request.get("size")
        if not isinstance(size, int) or not 0 <= size <= self.max_put_bytes:
            raise PeerError(f"bad size {size!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path):
            raise PeerError(f"{request.get('path')} exists")
        # a temporary name until every byte is in: a reader never sees a partial file under
        # the final name (a replica's manifest arriving last is its commit point)
        partial = f"{path}.part-{uuid.uuid4().hex[:8]}"
        try:
            with open(partial, "xb") as out:
                _receive_into(out, stream.read1, size, str(request.get("path")))  # type: ignore[attr-defined]
            os.link(partial, path)  # never replaces an existing name
        finally:
            os.unlink(partial)
        conn.sendall(_LENGTH.pack(0))

    def _resolve(self, request: dict) -> str:
        if not hmac.compare_digest(str(request.get("token", "")).encode(), self.token.encode()):
            raise PeerError("bad token")
        root = self.roots.get(str(request.get("root")))
        if root is None:
            raise PeerError(f"no root {request.get('root')!r}")
        return os.path.join(root, check_relative_path(str(request.get("path"))))

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _read_request(stream: BinaryIO) -> dict:
    raw = stream.readline(MAX_REQUEST)
    if not raw.endswith(b"\n"):
        raise PeerError("bad request")
    request = json.loads(raw)
    if not isinstance(request, dict):
        raise PeerError("bad request")
    return request


def _receive_into(out: BinaryIO, read: Callable[[int], bytes], size: int, what: str) -> None:
    """``size`` bytes from ``read`` into ``out``, then fsynced."""
    received = 0
    while received < size:
        chunk = read(min(CHUNK, size - received))
        if not chunk:
            raise PeerError(f"{what}: connection closed after {received} of {size} bytes")
        out.write(chunk)
        received += len(chunk)
    out.flush()
    os.fsync(out.fileno())


def _send_from(conn: socket.socket, handle: BinaryIO, size: int) -> int:
    """Up to ``size`` bytes of ``handle`` sent; returns how many (fewer if the file shrank)."""
    sent = 0
    while sent < size and (chunk := handle.read(min(CHUNK, size - sent))):
        conn.sendall(chunk)
        sent += len(chunk)
    return sent


def _reason(conn: socket.socket) -> str:
    """A refusal's reason, after its -1 length (length-prefixed, at most 1024 bytes)."""
    (length,) = struct.unpack("!I", _exactly(conn, 4))
    return _exactly(conn, min(length, 1024)).decode(errors="replace")


def _exactly(conn: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = conn.recv(min(CHUNK, count - len(data)))
        if not chunk:
            raise PeerError("connection closed early")
        data += chunk
    return bytes(data)


def fetch(address: tuple[str, int], token: str, root: str, path: str, target: str, *,
          max_bytes: int, exact: bool = False, timeout_s: float = 120.0) -> int:
    """Copy ``root``/``path`` from the peer at ``address`` into the new file ``target``
    (written and fsynced; removed on failure). ``exact``: it must be ``max_bytes`` long.
    Returns its size; raises ``PeerError``."""
    request = json.dumps({"token": token, "root": root, "path": path}).encode() + b"\n"
    created = False
    try:
        with socket.create_connection(address, timeout=timeout_s) as conn:
            conn.sendall(request)
            (size,) = _LENGTH.unpack(_exactly(conn, _LENGTH.size))
            if size < 0:
                raise PeerError(f"{address[0]}:{address[1]} did not serve {root}/{path}: {_reason(conn)}")
            if size > max_bytes or (exact and size != max_bytes):
                raise PeerError(f"{root}/{path} at {address[0]}:{address[1]} is {size} bytes, "
                                f"{'not' if exact else 'more than'} the {max_bytes} expected")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "xb") as out:
                created = True
                _receive_into(out, conn.recv, size, f"{root}/{path}")
            return size
    except (OSError, PeerError) as exc:
        if created:
            os.unlink(target)
        if isinstance(exc, PeerError):
            raise
        raise PeerError(f"cannot fetch {root}/{path} from {address[0]}:{address[1]}: {exc}") from exc


def push(address: tuple[str, int], token: str, root: str, path: str, source: str, *,
         timeout_s: float = 120.0) -> int:
    """Send the local file ``source`` as the new file ``root``/``path`` at the peer; returns
    its size; raises ``PeerError``."""
    try:
        with open_regular(source) as handle, socket.create_connection(address, timeout=timeout_s) as conn:
            size = os.fstat(handle.fileno()).st_size
            conn.sendall(json.dumps({"token": token, "root": root, "path": path, "op": "put",
                                     "size": size}).encode() + b"\n")
            sent = 0
            try:
                sent = _send_from(conn, handle, size)
            except OSError:  # the peer refused before reading it all: its reason, if it sent one
                pass
            (answer,) = _LENGTH.unpack(_exactly(conn, _LENGTH.size))
            if answer < 0:
                raise PeerError(f"{address[0]}:{address[1]} refused {root}/{path}: {_reason(conn)}")
            if sent != size:
                raise PeerError(f"{root}/{path}: sent {sent} of {size} bytes")
            return size
    except OSError as exc:
        raise PeerError(f"cannot push {root}/{path} to {address[0]}:{address[1]}: {exc}") from exc
