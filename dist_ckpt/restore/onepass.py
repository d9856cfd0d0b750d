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
   every rank loads or none does: no tensor of the job is written from a file that failed
   anywhere;
4. the items are read from the same mappings: the bytes deserialised are the bytes that were
   hashed, and the disk is read once. A plain tensor item is copied once, straight from the
   mapping into the tensor it loads into (``records``: its layout is read from the item's
   zip and pickle without deserialising the storage; ``copy_bytes``); anything else (BYTE_IO,
   transformed or unrecognised items) goes through torch's ``FileSystemReader.read_data``.

Scratch targets (``scratch``, set by the loader: the optimizer state, which ``set_state_dict``
adopts rather than copies, loaded into tensors that become the job's only if the load succeeds,
``scratch_optimizer_state``): their items are copied during step 2, on the main thread while
``read_data`` waits, each once the hash thread has read past it (its pages are in memory, read
once), so that most of the copying overlaps the reads instead of following the verdict. Those
bytes are not verified yet: a failed verdict drops the scratch tensors with the template, and
the job's own tensors were never written. An item that fails there for any reason is left to
step 4.

A file no rank's plan touches is not read (its size was checked at selection), except a
rank's own shard prefetched and then not needed: hashed, never used, its verdict ignored.
"""

from __future__ import annotations

import ctypes
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

import torch
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
# large enough for BLAKE3's threads; small enough to stop soon on close, and for the copies
# into scratch targets to follow the hash closely (``_copy_to_scratch``)
HASH_CHUNK = 64 << 20
SMALL_FILE = 4 << 20


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
        self._fetches: dict[str, Future[tuple[memoryview, bool]]] = {}
        # storages of load targets that are not the job's until the load succeeded (fresh
        # optimizer state: ``scratch_optimizer_state``); set by the caller before the load
        self.scratch: set[int] = set()
        self._early: dict[int, tuple[ReadItem, Any]] = {}  # id(item) -> (item, target) copied early
        self._hashed_upto: dict[str, int] = {}  # manifest path -> bytes hashed so far (hash thread)
        self._progress = threading.Condition()
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
            self._copy_to_scratch(plan, planner)
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
                early = self._early.get(id(req))
                if early is not None:  # its bytes were copied before the verdict, into scratch
                    planner.commit_tensor(req, early[1])
                    self.fast_items += 1
                elif not self._copy_item(req, planner):
                    fallback.append(req)
        self.fallback_items += len(fallback)
        return super().read_data(dataclasses.replace(plan, items=fallback), planner)

    def _copy_to_scratch(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Before the verdict (main thread, while the hash thread reads the same files): copy
        the items whose targets are scratch, so that those copies overlap the reads instead of
        following them. No tensor the job holds is written: a scratch target becomes the
        job's only when the load succeeded (``set_state_dict`` adopts it) and is dropped when
        it failed. Any item that fails here, for any reason, is left to ``_load_items`` (after
        the verdict, from verified bytes); nothing here raises."""
        if not self.scratch:
            return
        started = list(self._verifications)  # the hash thread's order
        items = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type != LoadItemType.TENSOR or info.transform_descriptors \
                    or info.relative_path not in self._verifications:
                continue
            try:  # the default planner only looks the target up
                target = planner.resolve_tensor(req)
            except Exception:  # noqa: BLE001 - left to _load_items, which raises what it raises
                continue
            if target.untyped_storage().data_ptr() in self.scratch:
                items.append((started.index(info.relative_path), info.offset, req))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for _, _, req in sorted(items, key=lambda item: item[:2]):
                info = self.storage_data[req.storage_index]
                # behind the hash thread: the pages are read once, by it, never ahead of it
                if not self._wait_hashed(info.relative_path, info.offset + info.length):
                    return
                try:
                    self._copy_item(req, planner, early=True)
                except Exception:  # noqa: BLE001 - unverified bytes: the verified pass decides
                    continue

    def _copy_item(self, req: ReadItem, planner: LoadPlanner, early: bool = False) -> bool:
        """Load one tensor item from its mapping; False (nothing resolved, nothing written)
        when the item is not one the fast path handles. ``early``: before the verdict, only
        into a scratch target, from the mapping as it is (``_copy_to_scratch``); not committed
        until ``_load_items``."""
        info = self.storage_data[req.storage_index]
        if req.type != LoadItemType.TENSOR or info.transform_descriptors:
            return False
        if early:
            mapping = self._fetches[info.relative_path].result()[0]
        else:
            mapping = self.mapped[info.relative_path]  # verified by every rank (read_data)
        if info.offset < 0 or info.offset + info.length > len(mapping):
            return False
        record = parse_tensor_record(mapping[info.offset:info.offset + info.length])
        part = None if record is None else narrowed(record, req.storage_offsets, req.lengths)
        if record is None or part is None:
            return False
        target = planner.resolve_tensor(req).detach()
        if early and target.untyped_storage().data_ptr() not in self.scratch:
            return False
        if target.size() != part.size():  # what torch's read_data asserts too
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {part.size()}")
        destination, source = copy_pair(mapping, info.offset + record.data_offset, record, part, target)
        copy_bytes(destination, source)
        del destination, source  # the source pins the mapping: close() unmaps it
        if early:
            self._early[id(req)] = (req, target)
            return True
        planner.commit_tensor(req, target)
        self.fast_items += 1
        return True

    def _verification(self, rel: str) -> Future[memoryview]:
        """The verified mapping of ``dcp/<rel>``, started once: the io thread fetches (downloads
        or pages in) the next file while the hash thread hashes this one (a small file: the io
        thread hashes it too)."""
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
        self._fetches[rel] = fetched
        # a small file (the small-items file) is hashed by the io thread, right after its fetch:
        # queued behind a large shard on the hash thread, it would hold the verdict back
        pool = self._pools[0] if entry.size <= SMALL_FILE else self._pools[1]
        started = pool.submit(self._verify, where, entry, fetched)
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
                with self._progress:  # the io thread hashes small files beside the hash thread
                    self.hashed_bytes += min(HASH_CHUNK, len(view) - start)
                self._advance(where, start + HASH_CHUNK)
            check_entry(self.generation, where, entry, len(view), digest.hexdigest())
        self._advance(where, len(view))
        return view

    def _advance(self, where: str, upto: int) -> None:
        with self._progress:
            self._hashed_upto[where] = upto
            self._progress.notify_all()

    def _wait_hashed(self, rel: str, end: int) -> bool:
        """Wait until the hash thread has read ``dcp/<rel>`` up to ``end`` (those pages are
        in memory); False when its verification ended without getting there (failed)."""
        where, verification = dcp_entry_path(rel), self._verifications[rel]
        with self._progress:
            while self._hashed_upto.get(where, 0) < end:
                if verification.done():
                    return self._hashed_upto.get(where, 0) >= end
                self._progress.wait(timeout=0.05)  # the hash thread notifies; done() does not
        return True

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
            # every fetch and hash finished (a load that succeeded): no thread touches a mapping
            # again, so the idle threads exit on their own instead of being waited for here
            busy = not all(f.done() for f in (*self._fetches.values(), *self._verifications.values()))
            for pool in self._pools:
                pool.shutdown(wait=busy, cancel_futures=True)
            self._pools = None
        self._fetches.clear()
        self._early.clear()
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


def copy_bytes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """``destination.copy_(source)``; between two dense host tensors of one dtype and one
    element order, a plain ``memmove`` of their bytes instead. libc's copy (string moves, and
    non-temporal stores for blocks past its threshold) moves the bytes of a large block with
    less memory traffic than torch's copy loop: with two ranks copying at once on the bench
    machine (issue 37), 512 MiB in 21 MiB items took 0.084 s against 0.10 to 0.12 s, and in one
    block 0.05 s against 0.17 s."""
    if (type(destination) is torch.Tensor and type(source) is torch.Tensor
            and destination.device.type == "cpu" and source.device.type == "cpu"
            and destination.layout == torch.strided and source.layout == torch.strided
            and destination.dtype == source.dtype and destination.shape == source.shape
            and destination.is_contiguous() and source.is_contiguous()
            and not (destination.is_conj() or destination.is_neg() or source.is_conj() or source.is_neg())):
        nbytes = destination.numel() * destination.element_size()
        if nbytes:
            ctypes.memmove(destination.data_ptr(), source.data_ptr(), nbytes)
        return
    destination.copy_(source)


def scratch_optimizer_state(template: dict[str, Any], *, fresh: bool) -> set[int]:
    """Give the optimizer state of a load ``template`` (``TrainState.tensor_state``) targets
    that are not the job's: ``set_state_dict`` adopts the loaded tensors (it does not copy
    them into the optimizer's), so the job's own state is untouched until the load succeeded
    and a failed load drops them. ``fresh``: the entries are already new (``optim_targets``
    built them for a stateless optimizer: what a restarted job has); otherwise each host
    tensor is replaced by an uninitialised one of its kind (host memory for the state while
    the load runs; a device tensor keeps its place and loads after the verdict). Returns their
    storages (``OnePassReader.scratch``)."""
    from torch.distributed.tensor import DTensor  # DCP imports it anyway

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    scratch: set[int] = set()
    optim = template.get("optim")
    states = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(states, dict):
        return scratch
    replaced: dict[Any, Any] = {}
    for name, entries in states.items():
        if isinstance(entries, dict):
            entries = dict(entries)  # a copy: the template's entries are the optimizer's own dicts
            for key, value in entries.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                if not fresh:
                    if local(value).device.type != "cpu":  # no second copy of device memory
                        continue
                    with torch.no_grad():
                        value = entries[key] = torch.empty_like(value, requires_grad=False)
                scratch.add(local(value).untyped_storage().data_ptr())
        replaced[name] = entries
    template["optim"] = {**optim, "state": replaced}
    return scratch


def own_shards(manifest: Manifest, rank: int) -> list[str]:
    """The ``dcp/``-relative shard files ``rank`` wrote: what it most likely loads (all of its
    load at the same world size), so worth hashing before DCP has planned."""
    return [dcp_relative_path(f.path) for f in manifest.files
            if f.rank == rank and (f.path.startswith(f"{DCP_DIR}/") or is_object_path(f.path))
            and f.path != METADATA_FILE]
