"""The record parser reads torch's zip archives with ``struct`` (``ziplayout._narrow``) and
hands anything else to ``zipfile``: where the narrow reader answers, its answer is zipfile's;
damaged items (cut short, a byte flipped) parse to None or to the record zipfile's path gives,
never to bytes outside the item, and never raise."""

from __future__ import annotations

import io
import mmap
import random
import struct
import zipfile
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

from dist_ckpt.restore import ziplayout
from dist_ckpt.restore.records import TensorRecord, parse_tensor_record
from dist_ckpt.save.shardio import without_zip_crc32


def saved(value: Any, crc: bool = False, at: int = 0) -> bytes:
    """One item as DCP writes it (``torch.save`` into the shard stream, ``at`` bytes in; by
    default without the zip CRC32, as dist_ckpt's writer saves)."""
    buffer = io.BytesIO()
    buffer.write(b"\xa5" * at)
    if crc:
        torch.save(value, buffer)
    else:
        with without_zip_crc32():
            torch.save(value, buffer)
    return buffer.getvalue()[at:]


def by_zipfile(item: bytes | memoryview) -> TensorRecord | None:
    """``parse_tensor_record`` as it was: every directory read by ``zipfile``."""
    with mock.patch.object(ziplayout, "_narrow", return_value=None):
        return parse_tensor_record(memoryview(item))


def zipfile_directory(item: bytes) -> dict[str, ziplayout.Entry] | None:
    try:
        return ziplayout._by_zipfile(memoryview(item))
    except Exception:  # whatever zipfile refuses the item with
        return None


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def check_record(item: bytes, record: TensorRecord | None, tensor: torch.Tensor) -> None:
    """``record`` describes ``tensor`` and its storage bytes lie inside ``item``."""
    assert record is not None
    assert (record.dtype, record.size, record.stride, record.storage_offset) == (
        tensor.dtype, tuple(tensor.size()), tensor.stride(), tensor.storage_offset())
    assert record.nbytes == tensor.untyped_storage().nbytes()
    assert 0 <= record.data_offset and record.data_offset + record.nbytes <= len(item)
    if record.nbytes:
        stored = torch.frombuffer(bytearray(item[record.data_offset:record.data_offset + record.nbytes]),
                                  dtype=record.dtype)
        rebuilt = stored.as_strided(record.size, record.stride, record.storage_offset)
        assert torch.equal(raw(rebuilt), raw(tensor))


def tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    grid = torch.randn(5, 8)
    found = [
        torch.arange(6, dtype=torch.float32), torch.randn(3, 4, 5), torch.randn(4, 6).t(),
        grid[1:, ::2], grid[2], torch.ones(3).expand(4, 3), torch.empty(0), torch.empty(0, 3),
        torch.tensor(3.5), torch.tensor(7, dtype=torch.int64), torch.randn(513 * 1024),
        torch.randn(3, 5).to(torch.bfloat16), torch.randn(7).half(), torch.randn(4, dtype=torch.float64),
        torch.arange(-9, 9, dtype=torch.int8), torch.arange(200, dtype=torch.uint8), torch.arange(5) > 2,
        torch.arange(10, dtype=torch.int32).view(2, 5)[:, 1:], torch.randn(3, dtype=torch.complex64),
    ]
    for name in ("float8_e4m3fn", "uint16", "uint32"):  # saved untyped, with an explicit dtype
        if hasattr(torch, name):
            found.append(torch.arange(6).to(getattr(torch, name)))
    return found


@pytest.mark.parametrize("crc", [False, True])
def test_the_narrow_reader_gives_zipfiles_records(crc: bool) -> None:
    for index, tensor in enumerate(tensors()):
        item = saved(tensor, crc=crc, at=index * 37)
        narrow = ziplayout._narrow(memoryview(item))
        assert narrow is not None, tensor  # torch's own archives never need zipfile
        assert narrow == zipfile_directory(item)
        record = parse_tensor_record(memoryview(item))
        assert record == by_zipfile(item)
        check_record(item, record, tensor)


def test_items_cut_short_parse_to_none() -> None:
    tensor = torch.randn(3, 4).t()
    item = saved(tensor)
    for cut in range(len(item)):
        assert ziplayout._narrow(memoryview(item[:cut])) is None
        assert parse_tensor_record(memoryview(item[:cut])) is None
        head_cut = item[cut + 1:]  # as if the item started late in its shard file
        assert ziplayout._narrow(memoryview(head_cut)) is None
        assert parse_tensor_record(memoryview(head_cut)) == by_zipfile(head_cut)


def header_positions(item: bytes) -> list[int]:
    """Every byte of the archive's structure: local headers, central directory, end records."""
    with zipfile.ZipFile(io.BytesIO(item)) as archive:
        infos = archive.infolist()
        start = archive.start_dir
    spans = [range(start, len(item))]
    for info in infos:
        name_length, extra_length = struct.unpack_from("<HH", item, info.header_offset + 26)
        spans.append(range(info.header_offset, info.header_offset + 30 + name_length + extra_length))
    return sorted({pos for span in spans for pos in span})


def test_damaged_headers_parse_as_zipfile_does_or_to_none() -> None:
    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)[:, 1:]
    item = saved(tensor)
    original = parse_tensor_record(memoryview(item))
    check_record(item, original, tensor)
    rng = random.Random(1)
    outcomes = {"none": 0, "same": 0, "other": 0}
    for pos in header_positions(item):
        for value in {item[pos] ^ 0x80, item[pos] ^ 0x01, 0x00, 0xFF, rng.randrange(256)} - {item[pos]}:
            damaged = item[:pos] + bytes([value]) + item[pos + 1:]
            narrow = ziplayout._narrow(memoryview(damaged))  # never raises
            assert narrow is None or narrow == zipfile_directory(damaged), (pos, value)
            record = parse_tensor_record(memoryview(damaged))
            assert record == by_zipfile(damaged), (pos, value)
            if record is not None:
                assert 0 <= record.data_offset <= len(damaged) - record.nbytes, (pos, value)
                assert record.nbytes == record.dtype.itemsize * 12
            outcomes["none" if record is None else "same" if record == original else "other"] += 1
    assert outcomes["none"] and outcomes["same"]  # bytes nobody reads, and bytes that matter


def directory_edited(item: bytes, edit: Callable[[bytes], bytes]) -> bytes:
    """``item`` (torch's shape: zip64 end records, no comment) with each central directory
    record passed through ``edit``, and the end records fixed up."""
    end64 = len(item) - 98
    size, offset = struct.unpack_from("<QQ", item, end64 + 40)
    records, pos = [], offset
    while pos < offset + size:
        lengths = struct.unpack_from("<3H", item, pos + 28)
        records.append(item[pos:pos + 46 + sum(lengths)])
        pos += len(records[-1])
    directory = b"".join(edit(record) for record in records)
    tail = bytearray(item[end64:])
    struct.pack_into("<Q", tail, 40, len(directory))
    struct.pack_into("<Q", tail, 56 + 8, offset + len(directory))
    struct.pack_into("<L", tail, 76 + 12, len(directory))
    return item[:offset] + directory + bytes(tail)


def as_zip64(record: bytes) -> bytes:
    """A central directory record whose sizes are in a zip64 extra field, as torch writes a
    record over 4 GiB."""
    packed, unpacked, name_length, extra_length = struct.unpack_from("<2L2H", record, 20)
    if not record[46:46 + name_length].endswith(b"/data/0"):
        return record
    head = bytearray(record[:46])
    struct.pack_into("<2L2H", head, 20, 0xFFFF_FFFF, 0xFFFF_FFFF, name_length, extra_length + 20)
    extra = struct.pack("<2H2Q", 1, 16, unpacked, packed)
    return bytes(head) + record[46:46 + name_length] + extra + record[46 + name_length:]


def with_foreign_extra(record: bytes) -> bytes:
    """A central directory record with one more (unknown) extra field block."""
    name_length, extra_length = struct.unpack_from("<2H", record, 28)
    head = bytearray(record[:46])
    struct.pack_into("<H", head, 30, extra_length + 6)
    end = 46 + name_length + extra_length
    return bytes(head) + record[46:end] + b"\xfe\xca\x02\x00ok" + record[end:]


def test_unusual_archives_go_to_zipfile() -> None:
    tensor = torch.randn(6, 5)
    item = saved(tensor, crc=True)  # zipfile checks the CRC32 of what it rewrites below
    record = parse_tensor_record(memoryview(item))
    check_record(item, record, tensor)
    zip64 = directory_edited(item, as_zip64)
    commented = item[:-2] + struct.pack("<H", 9) + b"a comment"
    claimed = item[:-2] + struct.pack("<H", 9)  # a comment length, and no comment
    assert ziplayout._narrow(memoryview(claimed)) is None
    assert parse_tensor_record(memoryview(claimed)) == by_zipfile(claimed)
    foreign_extra = directory_edited(item, with_foreign_extra)
    for variant in (zip64, commented, foreign_extra):
        assert ziplayout._narrow(memoryview(variant)) is None
        assert zipfile_directory(variant) is not None
        assert parse_tensor_record(memoryview(variant)) == record
    prefixed = b"\x00" * 64 + item  # zipfile reads it; its offsets shift with the prefix
    assert ziplayout._narrow(memoryview(prefixed)) is None
    assert parse_tensor_record(memoryview(prefixed)) == by_zipfile(prefixed)
    # no zip64 end records at all (Python's writer): the narrow reader reads that shape too
    rewritten = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(item)) as source, zipfile.ZipFile(rewritten, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    plain = rewritten.getvalue()
    assert b"PK\x06\x07" not in plain
    assert ziplayout._narrow(memoryview(plain)) == zipfile_directory(plain)
    check_record(plain, parse_tensor_record(memoryview(plain)), tensor)
    assert ziplayout._narrow(memoryview(plain[:-22] + plain[-22:-10] + b"\xff" * 8 + b"\x00\x00")) is None


def test_unsupported_zip_version_is_none_not_an_error() -> None:
    """zipfile raises NotImplementedError for a record that needs a newer zip version."""
    item = bytearray(saved(torch.ones(3)))
    item[item.find(b"PK\x01\x02") + 6] = 64
    assert ziplayout._narrow(memoryview(bytes(item))) is None
    assert parse_tensor_record(memoryview(bytes(item))) is None


class _HeadersOnly:
    """A ``torch.save`` target that keeps what it is given except the storage bytes."""

    def __init__(self) -> None:
        self.size = 0
        self.pieces: list[tuple[int, bytes]] = []

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes <= 1 << 20:
            self.pieces.append((self.size, view.tobytes()))
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass


def test_an_item_over_4_gib_goes_to_zipfile() -> None:
    """torch's own zip64 archive: sizes and offsets over 4 GiB sit in zip64 extra fields. The
    storage is never read or written: both sides are lazily mapped zero pages."""
    nbytes = (4 << 30) + 4096
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    try:
        source = mmap.mmap(-1, nbytes, flags=flags)
    except OSError:
        pytest.skip("no 4 GiB of address space")
    tensor = torch.frombuffer(source, dtype=torch.float32)
    target = _HeadersOnly()
    with without_zip_crc32():
        torch.save(tensor, target)
    del tensor
    try:
        item = mmap.mmap(-1, target.size, flags=flags)
    except OSError:
        source.close()
        pytest.skip("no 4 GiB of address space")
    for offset, piece in target.pieces:
        item[offset:offset + len(piece)] = piece
    view = memoryview(item)
    try:
        assert ziplayout._narrow(view) is None
        record = parse_tensor_record(view)
        assert record is not None and record.nbytes == nbytes and record.size == (nbytes // 4,)
        assert record.data_offset + nbytes <= len(view)
    finally:
        view.release()
        item.close()
        source.close()
