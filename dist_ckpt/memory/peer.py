"""Files between node leaders over torch.distributed: the memory tier's peer channel.

A file crosses as point-to-point tensors on a process group made for this purpose
(``Comm.new_group``: gloo, or NCCL where the job runs on CUDA): first its size (one int64,
-1 when the sender cannot send it), then its bytes in uint8 chunks of ``CHUNK``. No listener,
no address, no token: the transport is the one torch.distributed already set up between
exactly these processes.

Both sides know what is expected before a transfer starts (the restore exchange's routes, or a replica
offer): the file's size when the manifest lists it, else a bound. The sender sends the bytes
only when its file satisfies that; the receiver reads them only when the size it is told
does, so the two stay in step even when a file is refused.

The bytes are not trusted: the receiver hashes them as they arrive and checks size and
digest against the manifest entry before the file takes its final name (``receive_file``).

Call order: a transfer is ``send_file`` on the source and ``receive_file`` on the
destination, on the same group; at most one transfer at a time per group and process (the
callers order them: ``memory/exchange.py``, ``memory/replicas.py``).
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..digests import hasher
from ..errors import DistCkptError, ValidationError
from ..format.manifest import FileEntry
from ..format.validate import check_entry
from ..storage.local import open_regular

CHUNK = 32 << 20
UNLISTED_BYTES = 1 << 20  # a file the manifest does not list (its signature): at most this


class PeerError(DistCkptError):
    """A file did not cross the peer channel (refused, absent there, or failed its check)."""


class PeerChannel:
    """Transfers on ``group`` (a ``Comm.new_group``); ``device`` is where the tensors live
    (``cpu`` for gloo, the rank's CUDA device for NCCL)."""

    def __init__(self, group: Any, device: torch.device | None = None) -> None:
        self.group = group
        self.device = device or torch.device("cpu")

    def send_file(self, dst: int, path: str, entry: FileEntry | None, size: int | None = None) -> int:
        """Send ``path`` to global rank ``dst``; returns its size. A file that is absent, not
        regular, or not the size expected (``entry``'s, else ``size``, else at most
        ``UNLISTED_BYTES``) is refused (the receiver is told) and raises."""
        try:
            handle = open_regular(path)
        except (OSError, DistCkptError) as exc:
            self._send_size(dst, -1)
            raise PeerError(f"cannot send {path}: {exc}") from exc
        with handle:
            actual = os.fstat(handle.fileno()).st_size
            if not _fits(actual, entry, size):
                self._send_size(dst, -1)
                raise PeerError(f"{path} is {actual} bytes, {_expected(entry, size)}")
            self._send_size(dst, actual)
            if actual:
                # sent from the page cache (tmpfs: the memory tier itself), no copy in between
                with mmap.mmap(handle.fileno(), actual, access=mmap.ACCESS_READ) as view:
                    self._send_bytes(dst, view, actual)
        return actual

    def _send_size(self, dst: int, size: int) -> None:
        dist.send(torch.tensor([size], dtype=torch.int64, device=self.device), dst=dst, group=self.group)

    def _send_bytes(self, dst: int, view: mmap.mmap, size: int) -> None:
        with warnings.catch_warnings():  # a read-only mapping: torch warns, never writes into it
            warnings.simplefilter("ignore", UserWarning)
            for offset in range(0, size, CHUNK):
                chunk = torch.frombuffer(view, dtype=torch.uint8, offset=offset,
                                         count=min(CHUNK, size - offset)).to(self.device)
                dist.send(chunk, dst=dst, group=self.group)
            del chunk  # before the mapping closes: no tensor outlives it

    def receive_file(self, src: int, target: str, generation: str, name: str,
                     entry: FileEntry | None, expected: int | None = None) -> int:
        """Receive a file from global rank ``src`` as the new file ``target`` (never over an
        existing one), checked against ``entry`` (size and digest) before it takes that name;
        ``name`` is its path in ``generation``. Without an entry: ``expected`` bytes (else at
        most ``UNLISTED_BYTES``), unchecked until a reader checks it against its manifest.
        Returns its size; raises ``PeerError`` (nothing left at ``target``)."""
        size = self._receive_size(src)
        if size < 0:
            raise PeerError(f"{name} of {generation}: the node of rank {src} did not send it")
        if not _fits(size, entry, expected):  # the sender checks the same: nothing follows
            raise PeerError(f"{name} of {generation} from the node of rank {src} is {size} bytes, "
                            f"{_expected(entry, expected)}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.part-{uuid.uuid4().hex[:8]}"
        digest = hasher(entry.algorithm) if entry is not None else None
        try:
            with open(partial, "xb") as out:
                self._receive_bytes(src, out, size, digest)
                out.flush()
                os.fsync(out.fileno())
            if entry is not None and digest is not None:
                try:
                    check_entry(generation, name, entry, size, digest.hexdigest())
                except ValidationError as exc:
                    raise PeerError(f"{name} from the node of rank {src} fails its digest: {exc}") from exc
            os.link(partial, target)  # never over an existing file
        except OSError as exc:
            raise PeerError(f"cannot install {name} of {generation}: {exc}") from exc
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return size

    def _receive_size(self, src: int) -> int:
        box = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(box, src=src, group=self.group)
        return int(box.item())

    def _receive_bytes(self, src: int, out: Any, size: int, digest: Any) -> None:
        """Chunk by chunk into one buffer, written and hashed before the next (a second
        buffer, receiving the next chunk meanwhile, measured no faster on loopback)."""
        buffer = torch.empty(min(CHUNK, size), dtype=torch.uint8, device=self.device)
        for offset in range(0, size, CHUNK):
            count = min(CHUNK, size - offset)
            dist.recv(buffer[:count], src=src, group=self.group)
            data = memoryview(buffer[:count].cpu().numpy())
            out.write(data)
            if digest is not None:
                digest.update(data)


def _fits(size: int, entry: FileEntry | None, expected: int | None) -> bool:
    if entry is not None:
        return size == entry.size
    return size == expected if expected is not None else 0 <= size <= UNLISTED_BYTES


def _expected(entry: FileEntry | None, expected: int | None) -> str:
    if entry is not None:
        return f"not the {entry.size} its manifest says"
    if expected is not None:
        return f"not the {expected} announced"
    return f"more than the {UNLISTED_BYTES} an unlisted file may have"
