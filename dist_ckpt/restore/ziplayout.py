"""The records of one ``torch.save`` zip archive (one DCP item), read from its bytes.

:func:`central_directory` reads the end-of-central-directory records and the central directory
with ``struct``: torch's writer (PyTorchStreamWriter, miniz) emits one narrow shape, which
this reads in a fraction of ``zipfile``'s time (docs/performance.md). Anything outside that shape (an
archive comment, a zip64 extra field or a 0xFFFFFFFF size or offset, an extra field at all,
data before the archive, a non-ASCII name, a record running past the directory) goes to
``zipfile`` instead, over the same bytes: where the narrow reader answers, its answer is the
one ``zipfile`` gives. :func:`stored_range` then reads a record's local header to find where
its bytes start, bounds-checked against the item.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import Any


class Unusual(Exception):
    """An item the fast path does not handle; torch's path loads it instead."""


# what the reader needs of a central directory record: (compression method, compressed size,
# uncompressed size, offset of its local header)
Entry = tuple[int, int, int, int]


class MappedStream(io.RawIOBase):
    """A read-only, seekable stream over a memory mapping (no copy until read)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._view[self._pos:self._pos + len(target)]
        target[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


_STORED = 0  # zip compression method "stored"; torch.save never compresses
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header (30 bytes)
# a central directory record (46 bytes): signature, version needed to extract, method,
# compressed and uncompressed sizes, name, extra and comment lengths, local header offset
_CENTRAL = struct.Struct("<4s2xBx2xH8x2L3H8xL")
_END = struct.Struct("<4s4H2LH")  # end of central directory (22 bytes)
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator (20 bytes)
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory (56 bytes, no extensible data)
_TAIL = _END64.size + _LOCATOR.size + _END.size  # torch writes all three, even for small archives
_MAX_EXTRACT_VERSION = 63  # zipfile refuses (NotImplementedError) a record that needs more
_NARROW = 0xFFFF_FFFF  # a zip64 marker where a 32-bit size or offset would be


def _narrow(item: memoryview) -> dict[str, Entry] | None:
    """The central directory of an archive in torch's shape; None for anything else."""
    if len(item) < _TAIL:
        return None
    tail = bytes(item[len(item) - _TAIL:])
    end = len(item) - _END.size
    magic, _, _, _, _, size, offset, comment = _END.unpack_from(tail, _TAIL - _END.size)
    if magic != b"PK\x05\x06" or comment:
        return None  # no end record where an archive without a comment has it
    magic, disk, _, disks = _LOCATOR.unpack_from(tail, _END64.size)
    if magic == b"PK\x06\x07":
        if disk != 0 or disks > 1:
            return None
        magic, *_, size, offset = _END64.unpack_from(tail, 0)
        if magic != b"PK\x06\x06":
            return None
        end -= _END64.size + _LOCATOR.size
    elif _NARROW in (size, offset):
        return None
    if offset + size != end:
        return None  # data before the archive, or a directory that is not where it says
    directory = bytes(item[offset:end])
    entries: dict[str, Entry] = {}
    pos = 0
    while pos < size:
        if pos + _CENTRAL.size > size:
            return None
        magic, version, method, packed, unpacked, name_length, extra_length, comment_length, header = \
            _CENTRAL.unpack_from(directory, pos)
        start = pos + _CENTRAL.size
        pos = start + name_length + extra_length + comment_length
        name = directory[start:start + name_length]
        if (magic != b"PK\x01\x02" or version > _MAX_EXTRACT_VERSION or extra_length or pos > size
                or _NARROW in (packed, unpacked, header) or not name.isascii() or b"\x00" in name):
            return None  # zipfile would refuse it, truncate the name, or decode an extra field
        entries[name.decode("ascii")] = (method, packed, unpacked, header)
    return entries


def _by_zipfile(item: memoryview) -> dict[str, Entry]:
    with zipfile.ZipFile(MappedStream(item)) as archive:
        return {info.filename: (info.compress_type, info.compress_size, info.file_size, info.header_offset)
                for info in archive.infolist()}


def central_directory(item: memoryview) -> dict[str, Entry]:
    """Every record of the archive ``item``, by name (the last of a repeated name), as
    ``zipfile`` reads them. Raises what ``zipfile`` raises for a damaged archive."""
    entries = _narrow(item)
    return _by_zipfile(item) if entries is None else entries


def stored_range(item: memoryview, entry: Entry) -> tuple[int, int]:
    """(offset, length) of a stored record's bytes within ``item``, from its local header
    (its extra field, torch's alignment padding, may differ from the central directory's).
    The zip CRC is not checked: dist_ckpt writes none, the file digest covers the bytes."""
    method, packed, size, start = entry
    if method != _STORED or packed != size:
        raise Unusual("compressed record")
    if start < 0 or start + _LOCAL.size > len(item):
        raise Unusual("record header out of bounds")
    fields = _LOCAL.unpack_from(item, start)
    if fields[0] != b"PK\x03\x04":
        raise Unusual("bad local header")
    offset = start + _LOCAL.size + fields[9] + fields[10]
    if offset + size > len(item):
        raise Unusual("record out of bounds")
    return offset, size
