"""Small items framed as torch's legacy ``torch.save`` format, not as DCP's ``torch.save`` zip.

DCP frames every item as a ``torch.save`` zip: seven records with aligned headers and a
central directory, about 1.5 KiB around a tensor's bytes and 1.2 KiB around a pickled
object. For a rank's small items that framing costs more than the bytes it holds, so the
small-items file and the pack of small shared objects are written in the format
``torch.save(..., _use_new_zipfile_serialization=False)`` writes: about 0.3 KiB around a
tensor (``legacy_header`` then the storage bytes, ``write_legacy_item``) and 0.15 KiB around
an object (``write_legacy_object``). ``torch.load`` reads both formats, and so does DCP's
loader, so plain ``dcp.load`` needs no extra call; the one-pass restore's parser
(``dist_ckpt.restore.records``) tells the two apart by their first bytes.

The only caller is ``shardio.SmallItemsApartWriter._write_small_file``, on the rank that
writes the file, after DCP's writer threads are done. It asks ``legacy_framable`` first: a
tensor it refuses (a subclass, a view, a dtype without a legacy storage class, ...) keeps
DCP's zip framing.
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.serialization import INT_SIZE, LONG_SIZE, MAGIC_NUMBER, PROTOCOL_VERSION, SHORT_SIZE

# the dtypes torch's legacy format saves through a typed storage class (torch.FloatStorage,
# ...); the others (float8, the wider unsigned types) keep the zip framing
LEGACY_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex128, torch.complex64})
_LEGACY_PICKLE_PROTOCOL = 2  # torch.save's default (DEFAULT_PROTOCOL)
_LEGACY_STORAGE_KEY = "0"  # torch takes the storage's address: this one does not vary


class _LegacyPickler(pickle.Pickler):
    """torch's legacy pickler: a tensor's storage is a persistent id, its bytes follow the pickles."""

    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, torch.storage.TypedStorage):
            return ("storage", getattr(torch, obj._pickle_storage_type()), _LEGACY_STORAGE_KEY,
                    "cpu", obj._size(), None)
        return None


@functools.lru_cache(maxsize=4096)
def legacy_header(dtype: torch.dtype, size: tuple[int, ...], stride: tuple[int, ...]) -> bytes:
    """The bytes ``torch.save(t, f, _use_new_zipfile_serialization=False)`` writes before the
    storage bytes of a dense CPU tensor ``t`` (offset 0, its storage exactly its elements):
    the magic number, protocol version and system information pickles, the tensor's pickle,
    the list of its one storage key, and the storage's element count (int64, little-endian).
    Only the storage key differs from torch's (``"0"``, where torch writes an address), so a
    tensor of one dtype and shape is always framed alike (a cached plan's offsets repeat)."""
    out = io.BytesIO()
    system = {"protocol_version": PROTOCOL_VERSION, "little_endian": sys.byteorder == "little",
              "type_sizes": {"short": SHORT_SIZE, "int": INT_SIZE, "long": LONG_SIZE}}
    for value in (MAGIC_NUMBER, PROTOCOL_VERSION, system):
        pickle.dump(value, out, protocol=_LEGACY_PICKLE_PROTOCOL)
    probe = torch.empty_strided(size, stride, dtype=dtype)
    _LegacyPickler(out, protocol=_LEGACY_PICKLE_PROTOCOL).dump(probe)
    pickle.dump([_LEGACY_STORAGE_KEY], out, protocol=_LEGACY_PICKLE_PROTOCOL)
    out.write(struct.pack("<q", probe.numel()))
    return out.getvalue()


def legacy_framable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes, as they lie, are its legacy record's storage bytes."""
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided and tensor.device.type == "cpu"
            and tensor.dtype in LEGACY_DTYPES and sys.byteorder == "little" and not tensor.requires_grad
            and not tensor.is_conj() and not tensor.is_neg() and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def write_legacy_item(stream: io.IOBase, tensor: torch.Tensor, item: WriteItem,
                      storage_key: str) -> WriteResult:
    """One tensor item in torch's legacy format (``legacy_framable`` said yes), its bytes
    written from where they lie."""
    offset = stream.tell()
    stream.write(legacy_header(tensor.dtype, tuple(tensor.size()), tuple(tensor.stride())))
    if tensor.numel():
        stream.write(tensor.reshape(-1).view(torch.uint8).numpy())
    return _written_since(stream, offset, item, storage_key)


def write_legacy_object(stream: io.IOBase, value: Any, item: WriteItem, storage_key: str) -> WriteResult:
    """One non-tensor item (a ``BYTE_IO`` item: a learning rate, betas, a param group's list)
    as ``torch.save(value, f, _use_new_zipfile_serialization=False)`` writes it: about 0.15
    KiB around its pickle, where DCP's ``torch.save`` zip takes 1.2 KiB. ``torch.load``
    reads either, and so does DCP's loader (``load_bytes``)."""
    offset = stream.tell()
    framed = io.BytesIO()
    torch.save(value, framed, _use_new_zipfile_serialization=False)
    stream.write(framed.getbuffer())
    return _written_since(stream, offset, item, storage_key)


def _written_since(stream: io.IOBase, offset: int, item: WriteItem, storage_key: str) -> WriteResult:
    """The item written from ``offset`` to the stream's position, recorded as DCP records an
    item it wrote itself, so that DCP's ``.metadata`` and loader find it."""
    length = stream.tell() - offset
    return WriteResult(index=item.index, size_in_bytes=length,
                       storage_data=_StorageInfo(storage_key, offset, length))
