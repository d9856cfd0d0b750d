"""Where a tensor lies inside one DCP item, read from the bytes alone (no deserialisation).

DCP writes every tensor item as one ``torch.save`` zip archive inside a shard file. The
archive stores the storage bytes uncompressed (record ``<archive>/data/<key>``) and describes
the tensor in a small pickle (``<archive>/data.pkl``): dtype, size, stride, storage offset.
:func:`parse_tensor_record` finds both without copying the storage, so the one-pass reader
can copy the bytes straight from the verified mapping into the live tensor (one copy, where
``torch.load`` + ``copy_`` makes two and page-faults a fresh buffer in between).

A small tensor item (``save.shardio``'s small-items file) is in torch's legacy ``torch.save``
format instead: pickles of the magic number, protocol version and system information, the
tensor's pickle (the same shape as ``data.pkl``, its storage a 6-field persistent id), its
storage keys, the element count (int64) and the storage bytes. :func:`parse_tensor_record`
tells the two apart by their first bytes.

The parse is deliberately narrow: anything it does not recognise (another pickle shape, a
compressed or out-of-bounds record, a foreign byte order, tensor metadata, a subclass) makes
it return ``None``, and the caller hands that item to torch's own ``torch.load`` path. The
unpickler resolves a short allow-list of names only, so a verified item is never executed.
The zip records themselves are found by ``ziplayout`` (``struct`` for torch's own archives,
``zipfile`` for any other shape).
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

from .ziplayout import MappedStream, Unusual, central_directory, stored_range


@dataclass(frozen=True)
class TensorRecord:
    """One saved tensor: its layout over its storage, and where the storage bytes lie
    (``data_offset`` from the start of the item, ``nbytes`` long)."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data_offset: int
    nbytes: int


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int  # elements of ``dtype`` (bytes for an untyped storage)


@dataclass(frozen=True)
class _Layout:
    storage: _Storage
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


# the legacy typed-storage class names torch.save writes for the dtypes that have one (the
# others, float8 and the wider unsigned types, are saved untyped with an explicit dtype)
_STORAGE_TYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _layout(storage: Any, storage_offset: Any, size: Any, stride: Any, hooks: Any,
            dtype: torch.dtype, metadata: Any) -> _Layout:
    if not isinstance(storage, _Storage) or metadata or hooks:
        raise Unusual("tensor metadata or hooks")  # e.g. a conjugate bit: torch sets it
    if not all(isinstance(v, int) for v in (storage_offset, *size, *stride)) or len(size) != len(stride):
        raise Unusual("layout")
    return _Layout(storage, dtype, storage_offset, tuple(size), tuple(stride))


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, metadata: Any = None) -> _Layout:
    if not isinstance(storage, _Storage):
        raise Unusual("storage")
    return _layout(storage, storage_offset, size, stride, hooks, storage.dtype, metadata)


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, metadata: Any = None) -> _Layout:
    if not isinstance(dtype, torch.dtype):
        raise Unusual("dtype")
    return _layout(storage, storage_offset, size, stride, hooks, dtype, metadata)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class _LayoutUnpickler(pickle.Unpickler):
    """Resolves only the names a plain dense tensor's ``torch.save`` pickle uses; storages
    become descriptions (nothing is read or allocated). ``legacy``: a persistent id of the
    legacy format, which adds a view field (always None since torch 1.0)."""

    def __init__(self, file: Any, *, legacy: bool = False) -> None:
        super().__init__(file)
        self._legacy = legacy

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and name in _STORAGE_TYPES:
            return _StorageType(_STORAGE_TYPES[name])
        if (module, name) in {("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")}:
            return _StorageType(torch.uint8)  # counted in bytes; the dtype is an argument
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Unusual(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        fields = 6 if self._legacy else 5
        if not (isinstance(pid, tuple) and len(pid) == fields and pid[0] == "storage"):
            raise Unusual("persistent id")
        if self._legacy and pid[5] is not None:
            raise Unusual("storage view")
        _, kind, key, _location, numel = pid[:5]  # the location does not matter: bytes are bytes
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
            raise Unusual("storage id")
        return _Storage(kind.dtype, key, numel)


def _parse(item: memoryview) -> TensorRecord:
    records = central_directory(item)
    pickles = [name for name in records if name.count("/") == 1 and name.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise Unusual("no single data.pkl")
    prefix = pickles[0].rpartition("/")[0]
    order = records.get(f"{prefix}/byteorder")
    if order is None:  # torch would then guess; leave that to torch
        raise Unusual("no byte order record")
    start, length = stored_range(item, order)
    if bytes(item[start:start + length]).decode("ascii", "replace") != sys.byteorder:
        raise Unusual("foreign byte order")
    start, length = stored_range(item, records[pickles[0]])
    layout = _LayoutUnpickler(io.BytesIO(item[start:start + length])).load()
    if not isinstance(layout, _Layout):
        raise Unusual("not a tensor")
    data = records.get(f"{prefix}/data/{layout.storage.key}")
    if data is None:
        raise Unusual("no storage record")
    offset, nbytes = stored_range(item, data)
    element = layout.storage.dtype.itemsize
    if layout.storage.numel * element != nbytes or nbytes % layout.dtype.itemsize:
        raise Unusual("storage size")
    return TensorRecord(layout.dtype, layout.size, layout.stride, layout.storage_offset, offset, nbytes)


# how torch.save's legacy format starts (the magic number, pickled with torch's default protocol)
_LEGACY_START = pickle.dumps(MAGIC_NUMBER, protocol=2)


def _parse_legacy(item: memoryview) -> TensorRecord:
    """A tensor in the legacy format, read the way torch's ``_legacy_load`` reads it."""
    stream = io.BufferedReader(MappedStream(item))  # the unpickler peeks, never reads past a pickle

    def plain() -> Any:  # a pickle of plain values: any global or persistent id is Unusual
        return _LayoutUnpickler(stream).load()

    if plain() != MAGIC_NUMBER or plain() != PROTOCOL_VERSION:
        raise Unusual("not torch's legacy format")
    system = plain()
    if not isinstance(system, dict) or system.get("little_endian") is not (sys.byteorder == "little"):
        raise Unusual("foreign byte order")
    layout = _LayoutUnpickler(stream, legacy=True).load()
    if not isinstance(layout, _Layout):
        raise Unusual("not a tensor")
    if plain() != [layout.storage.key]:
        raise Unusual("storage keys")
    (numel,) = struct.unpack("<q", stream.read(8))
    element = layout.storage.dtype.itemsize
    offset, nbytes = stream.tell(), numel * element
    if numel != layout.storage.numel or offset + nbytes > len(item) or nbytes % layout.dtype.itemsize:
        raise Unusual("storage size")
    return TensorRecord(layout.dtype, layout.size, layout.stride, layout.storage_offset, offset, nbytes)


def parse_tensor_record(item: memoryview) -> TensorRecord | None:
    """The layout of the tensor saved as ``item`` (one DCP item's bytes), or None when the
    item is not a plain dense tensor (a zip archive or the legacy format) this parser knows."""
    try:
        if bytes(item[:len(_LEGACY_START)]) == _LEGACY_START:
            return _parse_legacy(item)
        return _parse(item)
    except (Unusual, zipfile.BadZipFile, pickle.UnpicklingError, struct.error, ValueError,
            TypeError, EOFError, IndexError, KeyError, AttributeError,
            NotImplementedError):  # zipfile's answer to a record that needs zip version > 6.3
        return None


def narrowed(record: TensorRecord, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor | None:
    """The part of the saved tensor a read request wants, as a meta tensor (layout only), or
    None when the request or the record's layout does not fit inside the stored bytes. The
    narrowing is torch's (``narrow_tensor_by_index``): a dimension is narrowed only where the
    request is shorter than the saved tensor."""
    numel = record.nbytes // record.dtype.itemsize
    try:
        part = torch.empty(numel, dtype=record.dtype, device="meta").as_strided(
            record.size, record.stride, record.storage_offset)
        whole = part.size()
        for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=False)):
            if length < whole[dim]:
                part = part.narrow(dim, offset, length)
    except (RuntimeError, IndexError, ValueError, TypeError):
        return None
    # meta tensors are not bounds-checked: every element the part reaches must be stored
    if part.numel() and (part.storage_offset() < 0 or min(part.stride(), default=0) < 0
                         or last_element(part) >= numel):
        return None
    return part


def last_element(part: torch.Tensor) -> int:
    """The storage index of the last element a (non-empty) strided view reaches."""
    return part.storage_offset() + sum((n - 1) * s for n, s in zip(part.size(), part.stride(), strict=True))


def copy_pair(mapping: memoryview, start: int, record: TensorRecord, part: torch.Tensor,
              target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, source) for ``destination.copy_(source)``: ``source`` views the stored
    bytes at ``mapping[start:]`` (no copy) where it can. The caller drops both after the copy:
    the source pins the mapping. ``part`` comes from :func:`narrowed`."""
    size = record.dtype.itemsize
    if part.numel() == 0:
        return target, torch.empty(part.size(), dtype=record.dtype)
    if (part.is_contiguous() and type(target) is torch.Tensor and target.layout == torch.strided
            and target.is_contiguous() and target.dtype == record.dtype
            and not target.is_conj() and not target.is_neg()):
        # the same bytes in the same order on both sides: a byte copy, whatever the alignment
        source = torch.frombuffer(mapping, dtype=torch.uint8, count=part.numel() * size,
                                  offset=start + part.storage_offset() * size)
        return target.reshape(-1).view(torch.uint8), source
    if start % size == 0:  # a typed view needs aligned elements (the mapping is page-aligned)
        whole = torch.frombuffer(mapping, dtype=record.dtype, count=record.nbytes // size, offset=start)
    else:  # rare (a strided part or a dtype conversion): an aligned copy, as torch.load makes
        whole = torch.frombuffer(mapping, dtype=torch.uint8, count=record.nbytes, offset=start)
        whole = whole.clone().view(record.dtype)
    return target, whole.as_strided(part.size(), part.stride(), part.storage_offset())
