"""Verified restore in one pass: every byte DCP loads is read from storage once, hashed
where it lies, and used only after every rank's bytes matched the manifest.

Call order (all ranks; ``prefetch`` before ``dcp.load``, which calls ``read_data`` on every
rank):

1. ``prefetch`` starts step 2 for the rank's own shards (what it loads at the same world
   size) while DCP plans; ``read_data`` lists the shard files this rank's load plan touches
   and starts step 2 for those not started yet;
2. each is brought to local disk once by the tier's reader (``local_copy``: the file itself
   on a POSIX root; a private copy for an object store, hashed while it downloads), mapped
   into memory and, unless the download hashed it, hashed through the mapping (BLAKE3
   releases the GIL and uses the rank's spare cores);
3. one all-gather of the verdicts (every rank reaches it, whatever failed), so that either
   every rank loads or none does: no tensor is written from a file that failed anywhere;
4. the items are read from the same mappings: the bytes deserialised are the bytes that were
   hashed, and the disk is read once. A plain tensor item is copied once, straight from the
   mapping into the tensor it loads into (``records``: its layout is read from the item's
   zip and pickle without deserialising the storage); anything else (BYTE_IO, transformed or
   unrecognised items) goes through torch's ``FileSystemReader.read_data``.

A file no rank's plan touches is not read (its size was checked at selection), except a
rank's own shard prefetched and then not needed: hashed, never used, its verdict ignored.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import PurePath
from typing import Any, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..digests import hasher
from ..errors import ValidationError
from ..format.manifest import (
    DCP_DIR,
    METADATA_FILE,
    FileEntry,
    Manifest,
    dcp_entry_path,
    dcp_relative_path,
    is_object_path,
)
from ..format.validate import check_entry
from ..protocol.comm import Comm
from ..storage.local import open_regular
from .records import copy_pair, narrowed, parse_tensor_record
from .ziplayout import MappedStream

HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
HASH_CHUNK = 256 << 20  # large enough for BLAKE3's threads; small enough to stop soon on close


class LocalCopies(Protocol):
    """What the one-pass reader needs from a tier's ``GenerationReader``."""

    errors: list[ValidationError]

    def read_metadata(self) -> Metadata: ...

    def local_copy(self, rel: str) -> tuple[str, bool]:
        """A local path holding ``dcp/<rel>``, and whether its bytes were already checked
        against the manifest on the way (a verified download)."""


class _MappedFileSystem(FileSystem):
    def __init__(self, owner: OnePassReader) -> None:
        super().__init__()
        self.owner = owner

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):  # type: ignore[override]
        if mode != "rb":
            raise ValidationError("a verified reader never writes", generation=self.owner.generation)
        # lexically: a shared object's name climbs out of dcp/ (``../../objects/<name>``)
        rel = PurePath(os.fspath(path)).relative_to(self.owner.path).as_posix()
        view = self.owner.mapped.get(rel)
        if view is None:  # only files read_data mapped and verified are ever served
            raise ValidationError(f"{self.owner.generation}: DCP asked for unverified {dcp_entry_path(rel)}",
                                  generation=self.owner.generation, path=dcp_entry_path(rel))
        with MappedStream(view) as stream:
            yield stream


class OnePassReader(FileSystemReader):
    """A DCP ``StorageReader`` that verifies what it serves (see the module docstring).
    Construct per load on every rank; ``close()`` on every rank afterwards."""

    def __init__(self, source: LocalCopies, comm: Comm, generation: str, manifest: Manifest,
                 root_hint: str = "/verified") -> None:
        super().__init__(root_hint)
        self.source = source
        self.comm = comm
        self.generation = generation
        self.manifest = manifest
        self.fs = _MappedFileSystem(self)
        self.mapped: dict[str, memoryview] = {}
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []  # over _maps, released before they are unmapped
        self._verifications: dict[str, Future[memoryview]] = {}
        self._pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._closing = threading.Event()
        self.errors = source.errors
        self.hashed_bytes = 0
        self.fast_items = 0  # tensor items copied straight from the mapping
        self.fallback_items = 0  # items left to torch's read_data

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.source.read_metadata()

    def prefetch(self, rels: Iterable[str]) -> None:
        """Start fetching and hashing ``rels`` (``dcp/``-relative) in the background, while
        DCP plans the load; ``read_data`` waits for those it needs and ignores the others (an
        unneeded file costs one hash, never a verdict). Only files the manifest lists."""
        for rel in rels:
            self._verification(rel)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        needed = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        failure: ValidationError | None = None
        rel = None
        try:
            pending = [(rel, self._verification(rel)) for rel in needed]
            for rel, verification in pending:
                self.mapped[rel] = verification.result()
        except ValidationError as exc:
            failure = exc
        except OSError as exc:  # an unreadable file fails the generation like a wrong one
            where = None if rel is None else dcp_entry_path(rel)  # named: restore may repair it
            failure = ValidationError(f"{self.generation}: cannot read shard {where}: {exc}",
                                      generation=self.generation, path=where)
        verdicts = self.comm.all_gather(None if failure is None else (str(failure), failure.path))
        failed = {rank: v for rank, v in enumerate(verdicts) if v is not None}
        if failed:
            rank = min(failed)
            message, path = failed[rank]
            error = ValidationError(message if failure is not None else f"rank {rank}: {message}",
                                    generation=self.generation, path=path)
            self.errors.append(error)
            raise error
        return self._load_items(plan, planner)

    def _load_items(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank's files verified: each plain tensor item is copied once, from its
        mapping into its target; torch's ``read_data`` loads the rest (same mappings)."""
        fallback: list[ReadItem] = []
        with warnings.catch_warnings():
            # frombuffer warns that a read-only mapping is not writable: it is only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for req in plan.items:
                if not self._copy_item(req, planner):
                    fallback.append(req)
        self.fallback_items += len(fallback)
        return super().read_data(dataclasses.replace(plan, items=fallback), planner)

    def _copy_item(self, req: ReadItem, planner: LoadPlanner) -> bool:
        """Load one tensor item from its mapping; False (nothing resolved, nothing written)
        when the item is not one the fast path handles."""
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        mapping = self.mapped[info.relative_path]  # verified by every rank (read_data)
        if info.offset < 0 or info.offset + info.length > len(mapping):
            return False
        record = parse_tensor_record(mapping[info.offset:info.offset + info.length])
        part = None if record is None else narrowed(record, req.storage_offsets, req.lengths)
        if record is None or part is None:
            return False
        target = planner.resolve_tensor(req).detach()
        if target.size() != part.size():  # what torch's read_data asserts too
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {part.size()}")
        destination, source = copy_pair(mapping, info.offset + record.data_offset, record, part, target)
        destination.copy_(source)
        del destination, source  # the source pins the mapping: close() unmaps it
        planner.commit_tensor(req, target)
        self.fast_items += 1
        return True

    def _verification(self, rel: str) -> Future[memoryview]:
        """The verified mapping of ``dcp/<rel>``, started once: the io thread fetches (downloads
        or pages in) the next file while the hash thread hashes this one."""
        started = self._verifications.get(rel)
        if started is not None:
            return started
        where = dcp_entry_path(rel)
        entry = self.manifest.file(where)
        if entry is None:  # only files the manifest lists are ever opened
            raise ValidationError(f"{self.generation}: DCP asked for {where}, which the manifest "
                                  "does not list", generation=self.generation, path=where)
        if self._pools is None:
            self._pools = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist-ckpt-restore-io"),
                           ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist-ckpt-restore-hash"))
        fetched = self._pools[0].submit(self._fetch, rel)
        started = self._pools[1].submit(self._verify, where, entry, fetched)
        self._verifications[rel] = started
        return started

    def _verify(self, where: str, entry: FileEntry, fetched: Future[tuple[memoryview, bool]]) -> memoryview:
        view, verified = fetched.result()
        check_entry(self.generation, where, entry, len(view))
        if not verified:  # BLAKE3 releases the GIL: DCP plans on the main thread meanwhile
            digest = hasher(entry.algorithm, threads=HASH_THREADS)
            for start in range(0, len(view), HASH_CHUNK):
                if self._closing.is_set():  # the load failed elsewhere: close() is waiting
                    raise ValidationError(f"{self.generation}: closed while hashing {where}",
                                          generation=self.generation, path=where)
                digest.update(view[start:start + HASH_CHUNK])
                self.hashed_bytes += min(HASH_CHUNK, len(view) - start)  # one hash thread: no race
            check_entry(self.generation, where, entry, len(view), digest.hexdigest())
        return view

    def _fetch(self, rel: str) -> tuple[memoryview, bool]:
        path, verified = self.source.local_copy(rel)
        with open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                return memoryview(b""), verified
            mapping = mmap.mmap(handle.fileno(), size, prot=mmap.PROT_READ)
        self._maps.append(mapping)
        if hasattr(mmap, "MADV_WILLNEED"):  # read ahead: the hash and DCP follow in order
            mapping.madvise(mmap.MADV_WILLNEED)
        view = memoryview(mapping)
        self._views.append(view)
        return view, verified

    def close(self) -> None:
        if self._pools is not None:  # no thread may still read a mapping when it is unmapped
            self._closing.set()
            for pool in self._pools:
                pool.shutdown(wait=True, cancel_futures=True)
            self._pools = None
        self._verifications.clear()
        self.mapped.clear()
        for view in self._views:
            try:
                view.release()
            except BufferError:  # a tensor over it still alive (an error's traceback)
                pass
        self._views.clear()
        for mapping in self._maps:
            try:
                mapping.close()
            except BufferError:  # a view DCP still holds: unmapped when it is collected
                pass
        self._maps.clear()


def own_shards(manifest: Manifest, rank: int) -> list[str]:
    """The ``dcp/``-relative shard files ``rank`` wrote: what it most likely loads (all of its
    load at the same world size), so worth hashing before DCP has planned."""
    return [dcp_relative_path(f.path) for f in manifest.files
            if f.rank == rank and (f.path.startswith(f"{DCP_DIR}/") or is_object_path(f.path))
            and f.path != METADATA_FILE]
