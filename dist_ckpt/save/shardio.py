"""DCP shard files written with their digest (BLAKE3 by default) computed on the way out.

DCP's ``FileSystemWriter`` fsyncs a data file through ``stream.fileno()`` while Python's
buffer may still hold its tail; here the filesystem fsyncs each file once, after its last
byte went out, and the stream hashes each byte as it is written, so that no file is read
back to get its digest. The bytes go past the page cache where that is possible
(``directio``).

A doomed save stops writing: once ``cancel`` is set (the rank's commit deadline passed) every
further write request raises ``SaveAbandoned`` instead of reaching the disk, so a slow disk
costs the job at most the deadline plus the request already in progress.

A small tensor costs its bytes: DCP frames each tensor item as a ``torch.save`` zip (seven
records with aligned headers and a central directory, about 1.5 KiB around the bytes), while
the tensors of a rank's small-items file are written in torch's legacy ``torch.save`` format
(``legacy_framing``: about 0.3 KiB), its non-tensor items too (about 0.15 KiB instead of
1.2), and so are the tensors of a pack (a rank's small frozen tensors in
one shared object, ``dist_ckpt.save.reuse``). ``torch.load``, and so plain ``dcp.load``, reads
both.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemWriter,
    SerializationFormat,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture
from torch.utils.serialization import config as serialization_config

from .. import faults
from ..digests import DEFAULT_ALGORITHM, hasher
from ..storage.directio import ALIGN, IN_PLACE_MIN, Sink, address, durable_file
from .legacy_framing import legacy_framable, write_legacy_item, write_legacy_object

_crc_lock = threading.Lock()
_crc_off_writers = 0
_crc_saved: bool | None = None
_ZEROS = bytes(ALIGN)
_storage_offset_guess: int | None = None  # learned from the last large item written (any stream)


try:  # private helpers of torch's writer; without them the writer keeps DCP's own layout
    from torch.distributed.checkpoint.filesystem import _item_size, _split_by_size_and_type
except ImportError:  # pragma: no cover - another torch release
    _item_size = _split_by_size_and_type = None  # type: ignore[assignment]
try:  # DCP's framing of one item; without it every small item keeps DCP's own framing too
    from torch.distributed.checkpoint.filesystem import _write_item
except ImportError:  # pragma: no cover - another torch release
    _write_item = None  # type: ignore[assignment]

SMALL_ITEM_BYTES = 64 << 10  # SmallItemsApartWriter: what goes to a rank's small-items file
_GATHER_BELOW = 16 << 10  # HashingStream: writes this small are gathered ...
_GATHER_MAX = 256 << 10  # ... up to this much


@contextmanager
def without_zip_crc32() -> Generator[None, None, None]:
    """DCP stores each tensor as a ``torch.save`` zip whose writer computes a CRC32 of every
    byte, on the writer's core, at a cost comparable to the digest's (docs/performance.md).
    The file digest already covers every byte, so the CRC is skipped while shard files are
    written; ``torch.load`` (and so ``dcp.load``) does not check it. The switch is torch's
    ``torch.utils.serialization.config.save.compute_crc32``: process-wide in torch 2.11 (a
    ``torch.save`` that another thread runs meanwhile writes a zip without CRC32 too, which
    ``torch.load`` reads the same); in 2.13 an override holds for the caller's context only,
    so a thread started without a copy of it (DCP's extra writer threads) computes the CRC."""
    global _crc_off_writers, _crc_saved
    with _crc_lock:
        if _crc_off_writers == 0:
            _crc_saved = serialization_config.save.compute_crc32
            serialization_config.save.compute_crc32 = False
        _crc_off_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_off_writers -= 1
            if _crc_off_writers == 0 and _crc_saved is not None:
                serialization_config.save.compute_crc32 = _crc_saved


def _storage_offset_in_record() -> int:
    """Where ``torch.save`` puts a small 2-D tensor's bytes inside its record: the first guess
    of ``HashingStream`` before it has seen a large item (the same for most tensors: torch
    aligns the storage record to 64 bytes, which absorbs small differences in the pickle)."""
    probe = torch.zeros(2, 2)
    found: list[int] = []

    class Counting(io.RawIOBase):
        position = 0

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:  # type: ignore[override]
            view = memoryview(data)
            if len(view) == probe.nbytes and address(view) == probe.data_ptr():
                found.append(self.position)
            self.position += len(view)
            return len(view)

    with without_zip_crc32():
        torch.save(probe, Counting())
    return found[0] if found else 0


def _saves_objects_plainly(planner: SavePlanner) -> bool:
    """Whether ``planner`` frames a non-tensor item as DCP's default planner does (the
    ``torch.save`` of the object it looks up): then the legacy framing of that same object
    is equivalent."""
    return (isinstance(planner, DefaultSavePlanner)
            and type(planner).transform_object is DefaultSavePlanner.transform_object
            and type(planner).resolve_data is DefaultSavePlanner.resolve_data)


class SaveAbandoned(OSError):
    """The rank stopped writing a generation that can no longer commit (its deadline passed)."""


class HashingStream(io.RawIOBase):
    """A write-only stream over a :class:`~dist_ckpt.storage.directio.Sink` that hashes each byte on its way
    and counts them (``tell`` is the count: DCP records each item's offset with it).

    ``align_items``: each item is placed (zero bytes before it, which no item covers) so that
    its storage bytes, which lie a few hundred bytes into its ``torch.save`` record, start at
    a multiple of ``ALIGN`` in the file: a direct sink then writes them from the page-aligned
    staging buffer without a copy. Where they lie in the record is learned from the last
    large item (a first guess from a probe); a wrong guess only costs that item the copy.
    DCP's writer calls ``tell`` twice per item, before its first byte and after its last; a
    ``tell`` with no write since the previous one (or the first) is an item's start, and only
    there is padding added, once per offset: an empty item's end is where its start was
    placed, so no item's recorded length ever covers padding."""

    def __init__(self, sink: Sink, on_error: Any = None,
                 cancel: threading.Event | None = None, rank: int | None = None,
                 algorithm: str = DEFAULT_ALGORITHM, *, align_items: bool = False) -> None:
        super().__init__()
        self._sink = sink
        self._digest = hasher(algorithm)
        self.size = 0
        self._on_error = on_error
        self._cancel = cancel
        self._rank = rank
        self._align_items = align_items
        self._wrote_since_tell = False
        self._item_start: int | None = None  # of the item being written, while it is unmeasured
        # torch.save writes each record in dozens of small pieces (zip headers, the pickle):
        # gathered here, they reach the sink and the digest in a few calls, not one per piece
        self._pending = bytearray()
        self._fault_armed = faults.armed("write.request")  # asked once per file

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self._request()
        if len(view) < _GATHER_BELOW:
            self._pending += view
            if len(self._pending) >= _GATHER_MAX:
                self._flush_pending()
        else:
            self._flush_pending()
            self._send(view)
        if self._item_start is not None and len(view) >= IN_PLACE_MIN:
            _learn_storage_offset(self.size - self._item_start)  # the item's storage bytes
            self._item_start = None
        self.size += len(view)
        self._wrote_since_tell = True
        return len(view)

    def _check_cancel(self) -> None:
        if self._cancel is not None and self._cancel.is_set():
            raise SaveAbandoned("the commit deadline passed: remaining writes abandoned")

    def tell(self) -> int:
        # an item's start; never twice at one offset (an empty item's end: another thread's
        # item may have changed the guess meanwhile, and its length must stay 0)
        if self._align_items and not self._wrote_since_tell and self._item_start != self.size:
            padding = -(self.size + storage_offset_guess()) % ALIGN
            if padding:
                self._pad(padding)
            self._item_start = self.size
        self._wrote_since_tell = False
        return self.size

    def _pad(self, count: int) -> None:
        self._flush_pending()
        self._send(memoryview(_ZEROS)[:count])
        self.size += count

    def _request(self) -> None:
        """One of DCP's write requests: cancellable, and where a slow or failing disk is
        injected (per request)."""
        self._check_cancel()
        if self._fault_armed:
            try:
                faults.hit("write.request", self._rank)
            except OSError as exc:
                if self._on_error is not None:
                    self._on_error(exc)
                raise

    def finish(self) -> None:
        """The gathered tail to the sink (before the sink finishes the file)."""
        self._flush_pending()

    def _flush_pending(self) -> None:
        if self._pending:
            with memoryview(self._pending) as view:
                self._send(view)
            self._pending.clear()

    def _send(self, view: memoryview) -> None:
        """Hand ``view`` to the sink and the digest."""
        try:
            self._sink.write(view, self._digest.update)
        except OSError as exc:
            # torch.save's native writer reports a failed write as "unexpected pos": keep
            # the real cause (ENOSPC, EIO) for the rank's report
            if self._on_error is not None:
                self._on_error(exc)
            raise

    def flush(self) -> None:
        pass  # a direct sink writes whole aligned blocks only; durable_file finishes the rest

    def fileno(self) -> int:
        raise io.UnsupportedOperation("the shard stream fsyncs itself once its last byte is out")

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def storage_offset_guess() -> int:
    global _storage_offset_guess
    if _storage_offset_guess is None:
        _storage_offset_guess = _storage_offset_in_record()
    return _storage_offset_guess


def _learn_storage_offset(offset: int) -> None:
    global _storage_offset_guess
    _storage_offset_guess = offset  # one int: what another writer thread reads is either value


class HashingFileSystem(FileSystem):
    """DCP filesystem whose write streams record (size, digest) per file path; ``direct``
    writes the files past the page cache where the filesystem allows (``directio``), each
    item of a file not named in ``unaligned`` at an aligned offset (``HashingStream``)."""

    def __init__(self, cancel: threading.Event | None = None, rank: int | None = None,
                 algorithm: str = DEFAULT_ALGORITHM, *, direct: bool = False) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.direct = direct
        self.digests: dict[str, tuple[int, str]] = {}
        self.errors: list[OSError] = []  # write errors, in the order they happened
        self.cancel = cancel
        self.rank = rank
        self.created: list[str] = []  # every file opened for writing, for cleanup on failure
        self.unaligned: set[str] = set()  # file names whose items are packed (small items)
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self._lock:
            self.created.append(os.fspath(path))
        name = os.path.basename(os.fspath(path))
        with durable_file(os.fspath(path), direct=self.direct) as sink:
            stream = HashingStream(sink, on_error=self.errors.append, cancel=self.cancel, rank=self.rank,
                                   algorithm=self.algorithm,
                                   align_items=sink.direct and name not in self.unaligned)
            yield stream
            stream._check_cancel()  # no tail, no fsync of a doomed file either
            stream.finish()
        with self._lock:
            self.digests[name] = (stream.size, stream.hexdigest())


class SmallItemsApartWriter(FileSystemWriter):
    """DCP's file writer, with a rank's small items (non-tensor objects, tensors up to
    ``SMALL_ITEM_BYTES``) in a file of their own, after its tensor files. DCP saves a
    replicated tensor (an optimizer step count) once, in one rank's file: every other rank
    that loads it then reads that small file, not the rank's whole shard. A verified restore
    hashes every file it reads from, so with one file per rank an FSDP restore hashed twice
    the bytes on one rank; an object-store restore downloaded them, and another node of the
    memory tier received them (``memory/routes.py``).

    Shared objects (``object_items``): one file each over ``SMALL_ITEM_BYTES``; the smaller
    ones together in one file, a pack, written like the small-items file.

    The small-items file's items and the pack's are framed in torch's legacy format
    (``legacy_framing``), after DCP's writer threads are done
    (``_write_beside``); every other item, and every item of the other files, keeps DCP's own
    framing and path."""

    object_items: frozenset = frozenset()  # MetadataIndex of items written as shared objects
    object_name: Callable[[str, int], str] | None = None  # (prefix, index) -> name below dcp/

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if _split_by_size_and_type is None or not hasattr(self, "_write_data"):
            if self.object_items:
                raise RuntimeError("this torch's DCP writer cannot write shared objects apart")
            return super().write_data(plan, planner)
        small: list[WriteItem] = []
        large: list[WriteItem] = []
        files: queue.Queue = queue.Queue()
        unaligned: list[str] = []
        legacy = self._legacy_framing()
        pack = self._queue_objects(plan, files, unaligned)
        small_files: list[tuple[Any, str, list[WriteItem]]] = []
        if pack is not None:
            if legacy:
                small_files.append(pack)
            else:
                files.put(pack)
        medium: list[WriteItem] = []  # over SMALL_ITEM_BYTES, under IN_PLACE_MIN
        for item in plan.items:
            if item.index in self.object_items:
                continue
            is_small = item.type == WriteItemType.BYTE_IO or _item_size(item) <= SMALL_ITEM_BYTES
            (small if is_small else medium if _item_size(item) < IN_PLACE_MIN else large).append(item)
        buckets = [b for b in _split_by_size_and_type(self.thread_count, large) if b]
        # an item under IN_PLACE_MIN takes the write buffer's copy wherever it lies: aligning it
        # would only add padding (up to ALIGN bytes per item, most of a small generation's
        # overhead), so such items share files whose items are packed
        packed = [b for b in _split_by_size_and_type(self.thread_count, medium) if b]
        for index, bucket in enumerate([*buckets, *packed, *([small] if small else [])]):
            name = f"{plan.storage_data.prefix}{index}{DEFAULT_SUFFIX}"
            if index >= len(buckets):
                unaligned.append(name)
            if bucket is small and legacy:
                small_files.insert(0, (self.fs.concat_path(self.path, name), name, bucket))
            else:
                files.put((self.fs.concat_path(self.path, name), name, bucket))
        if isinstance(self.fs, HashingFileSystem):
            self.fs.unaligned.update(unaligned)
        if not small_files:
            return self._write_data(planner, files)
        return self._write_beside(planner, files, small_files)

    def _queue_objects(self, plan: SavePlan, files: queue.Queue, unaligned: list[str]
                       ) -> tuple[Any, str, list[WriteItem]] | None:
        """Each object item over ``SMALL_ITEM_BYTES`` to ``files``, a file of its own; returns
        the others as one file to write (a pack: one shared object holding a rank's small
        frozen tensors, each at its own offset, named by the digest of the whole), or None."""
        assert self.object_name is not None or not self.object_items
        packed: list[WriteItem] = []
        for item in plan.items:
            if item.index not in self.object_items:
                continue
            if _item_size(item) <= SMALL_ITEM_BYTES:
                packed.append(item)
                continue
            name = self.object_name(plan.storage_data.prefix, files.qsize())  # type: ignore[misc]
            files.put((self.fs.concat_path(self.path, name), name, [item]))
            if _item_size(item) < IN_PLACE_MIN:
                unaligned.append(os.path.basename(name))
        if not packed:
            return None
        name = self.object_name(plan.storage_data.prefix, files.qsize())  # type: ignore[misc]
        unaligned.append(os.path.basename(name))
        return self.fs.concat_path(self.path, name), name, packed

    def _legacy_framing(self) -> bool:
        """Whether this writer writes the small-items file itself, its tensors in the legacy
        framing: only where DCP would frame them with plain ``torch.save`` (no stream
        extension, no safetensors) and the filesystem fsyncs each file itself (this writer's
        ``sync_files`` is off)."""
        return (_write_item is not None and isinstance(self.fs, HashingFileSystem)
                and not self.transforms.extensions
                and getattr(self, "serialization_format", SerializationFormat.TORCH_SAVE)
                == SerializationFormat.TORCH_SAVE)

    def _write_beside(self, planner: SavePlanner, files: queue.Queue,
                      small_files: list[tuple[Any, str, list[WriteItem]]]) -> TorchFuture:
        """DCP writes ``files``, then this thread writes the small-items file and the pack of
        small shared objects, as DCP itself would have (its queue ends with them). Not on a
        thread of their own beside DCP's: that saves a few milliseconds of writes and fsync,
        and a third thread resolving, hashing and writing beside DCP's writer competes with
        the training steps for the CPU."""
        rest = self._write_data(planner, files).wait() if not files.empty() else []
        done: TorchFuture = TorchFuture()
        done.set_result(rest + [r for small_file in small_files
                                for r in self._write_small_file(planner, *small_file)])
        return done

    def _write_small_file(self, planner: SavePlanner, path: Any, name: str,
                          items: list[WriteItem]) -> list[WriteResult]:
        """The small-items file (or a pack), as DCP's ``_write_files_from_queue`` writes one
        (non-tensor items first, then tensors, each detached, on the CPU and no larger than
        its storage), each tensor ``legacy_framable`` allows and each non-tensor item of a
        default planner in the legacy framing, anything else by DCP."""
        assert _write_item is not None
        results: list[WriteResult] = []
        with self.fs.create_stream(path, "wb") as stream:
            plain_objects = _saves_objects_plainly(planner)
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    continue
                if plain_objects:
                    results.append(write_legacy_object(stream, planner.lookup_object(item.index), item, name))
                else:
                    results.append(_write_item(self.transforms, stream, planner.resolve_data(item), item,
                                               name, SerializationFormat.TORCH_SAVE))
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                tensor = planner.resolve_data(item).detach().cpu()
                if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # a view: DCP's loader clones it too
                if legacy_framable(tensor):
                    results.append(write_legacy_item(stream, tensor, item, name))
                else:
                    results.append(_write_item(self.transforms, stream, tensor, item, name,
                                               SerializationFormat.TORCH_SAVE))
        return results


def hashing_writer(path: str, *, thread_count: int, cancel: threading.Event | None = None,
                   rank: int | None = None, algorithm: str = DEFAULT_ALGORITHM,
                   direct: bool = False, object_items: frozenset = frozenset(),
                   object_name: Callable[[str, int], str] | None = None,
                   ) -> tuple[FileSystemWriter, HashingFileSystem]:
    """DCP's writer over a hashing filesystem; ``object_items`` are written each to a file of
    its own named by ``object_name`` (``dist_ckpt.save.reuse``)."""
    # sync_files=False: the filesystem fsyncs each file once, after its last byte is out
    writer = SmallItemsApartWriter(path, single_file_per_rank=True, sync_files=False,
                                   thread_count=thread_count, overwrite=True)
    writer.object_items = object_items
    writer.object_name = object_name
    filesystem = HashingFileSystem(cancel, rank, algorithm, direct=direct)
    writer.fs = filesystem
    return writer, filesystem
