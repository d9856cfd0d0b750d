"""Incremental generations: which frozen tensors a save references instead of writing them.

A tensor item is written once as a shared object (``ROOT/objects/<digest>.distcp``: its own
file over ``SMALL_ITEM_BYTES``; a rank's smaller ones together, one pack per save that writes
any, each item at its own offset) and referenced by later generations while its bytes provably
did not change. A pack is referenced item by item: an item whose proof failed is written again
(in a new pack), the others keep pointing into the old one, which every generation that still
references an item of it lists in its manifest. Proof is
the parameter's history, never a guess: the tensor is a parameter of the model (buffers are
not: torch mutates some of them, BatchNorm's statistics, without bumping their version
counter), frozen (``requires_grad=False``, or in none of the optimizer's param groups), the
same parameter object as at the save that wrote the object, with the same data pointer, size
and dtype, and the same version counters (the parameter's own and, for a DTensor, its local
shard's; every in-place op through the parameter bumps one). A write through ``.data`` has a
counter of its own and is invisible: docs/incremental.md says so, and ``incremental=False``
or ``CheckpointManager.rewrite_frozen()`` cover it.

Protocol (every rank, for its own items; no collective):

1. main thread, in ``save()`` before staging: ``ReuseLedger.decide(live, fingerprint)`` gives
   a :class:`ReuseDecision`: the proof of every frozen candidate now, and those whose proof equals
   the one recorded for the newest generation this rank saw committed (``reused``): they are
   neither copied to staging nor written nor hashed (``keeps_live``);
2. save thread, in the write (``dist_ckpt.save.coordinator``): ``split_plan`` takes the reused
   items out of the DCP plan (their write results point at the recorded objects) and names the
   candidates written this time as object items, each written to a file of its own below the
   attempt's ``objects/`` and renamed to its digest (``name_objects``);
3. when the outcome is known (``on_done``, save thread): a committed generation's records
   replace the ledger's when it is newer than theirs.

Reuse only ever follows the newest committed generation, which retention never deletes, and
a generation that references an object lists it in its manifest: so an object a save is
about to reference is always referenced by a kept generation (docs/incremental.md, "Why
pruning never deletes an object in use").
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_dtensor, _create_chunk_from_tensor
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from .. import logs
from ..errors import StagingError, StorageError
from ..format.manifest import (
    DCP_OBJECT_PREFIX,
    MANIFEST_NAME,
    OBJECTS_DIR,
    FileEntry,
    Manifest,
    dcp_entry_path,
    is_object_path,
    object_path,
    parse_generation,
)
from .planning import layout_fingerprint
from .shardio import SMALL_ITEM_BYTES

log = logs.get(__name__)

NEW_OBJECT_PREFIX = ".new-"  # an object file before it is named by its digest
# a rank's frozen tensors of up to SMALL_ITEM_BYTES become candidates (one packed object)
# only when together they reach this many bytes (``ReuseLedger._proofs``)
PACK_MIN_BYTES = SMALL_ITEM_BYTES


@dataclass(frozen=True)
class Proof:
    """What must be equal for a tensor's bytes to be the same as at an earlier save."""

    owner: int  # id() of the parameter object (its weak reference is kept beside)
    versions: tuple[int, ...]
    data_ptr: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Record:
    """One item of a committed generation held as a shared object."""

    proof: Proof
    sizes: tuple[int, ...]  # the chunk's sizes (its offsets are the key)
    result: WriteResult  # storage_data: ../../objects/<name>
    entry: dict  # the object's manifest entry (path, size, digest, rank)


Chunk = tuple[int, ...]  # a chunk's offsets


@dataclass
class ReuseDecision:
    """One save's decision (``ReuseLedger.decide``)."""

    proofs: dict[str, Proof]  # fqn -> proof: every frozen candidate of this save
    reused: dict[str, dict[Chunk, Record]]  # fqn -> its chunks' records: not written
    live_ids: frozenset[int]  # id() of the live tensors of ``reused``: not staged
    owners: dict[str, weakref.ref] = field(default_factory=dict)
    written: dict[str, dict[Chunk, Record]] = field(default_factory=dict)  # set by the write
    # id() of frozen candidates the cached plan gives to another rank (DCP writes a replicated
    # item once: with DDP each rank writes about 1/world of the base): not staged either,
    # unless the save plans again (``stage_everything_written``)
    elsewhere_ids: frozenset[int] = frozenset()

    def keeps_live(self, tensor: torch.Tensor) -> bool:
        """Whether staging leaves ``tensor`` out (the staged structure holds the live one)."""
        return id(tensor) in self.live_ids or id(tensor) in self.elsewhere_ids

    def stage_everything_written(self) -> bool:
        """The save plans again (not every rank had the plan cached), so another rank's item
        may become this rank's: from now on only the reused tensors stay unstaged. Returns
        whether anything changed (the caller stages again)."""
        changed = bool(self.elsewhere_ids)
        self.elsewhere_ids = frozenset()
        return changed

    @property
    def reused_bytes(self) -> int:
        return sum(r.proof.nbytes for chunks in self.reused.values() for r in chunks.values()) \
            if self.reused else 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # no autograd node


def _versions(param: torch.Tensor) -> tuple[int, ...]:
    if isinstance(param, DTensor):
        return (param._version, param._local_tensor._version)
    return (param._version,)


class ReuseLedger:
    """One rank's records of the frozen tensors it holds as shared objects (module docstring).
    ``decide`` runs on the main thread, ``settle`` on save threads: a lock guards the records."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, *, full_every: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.full_every = full_every
        self.records: dict[str, dict[Chunk, Record]] = {}
        self.owners: dict[str, weakref.ref] = {}
        self.fingerprint: str | None = None  # the layout the records were written under
        self.update = -1  # next_update of the generation the records come from
        self.decided = 0
        self.forced = False  # rewrite_frozen(): the next save writes every candidate
        self._lock = threading.Lock()

    def rewrite_frozen(self) -> None:
        """The next save writes every frozen tensor in full (after a change the version
        counter cannot see, such as a write through ``.data``)."""
        with self._lock:
            self.forced = True

    def _frozen_params(self) -> dict[int, torch.Tensor]:
        """Frozen parameters by the data pointer of their local bytes."""
        trained: set[int] = set()
        if self.optimizer is not None:
            for group in getattr(self.optimizer, "param_groups", []):
                trained.update(id(p) for p in group["params"])
        found: dict[int, torch.Tensor] = {}
        for param in self.model.parameters():
            if param.requires_grad and (self.optimizer is None or id(param) in trained):
                continue
            local = _local(param)
            if local.numel():
                found[local.data_ptr()] = param
        return found

    @torch.no_grad()
    def decide(self, live: Any, fingerprint: str, mine: frozenset[str] | None = None) -> ReuseDecision:
        """Main thread, in ``save()``, before staging: the proofs and what is reused. ``mine``:
        the keys this rank writes under the cached plan for ``fingerprint`` (None: unknown)."""
        proofs, owners, kept = self._proofs(live)
        with self._lock:
            self.decided += 1
            full = self.forced or (self.full_every > 0 and self.decided % self.full_every == 0)
            self.forced = False
            reused = {} if full or fingerprint != self.fingerprint else {
                fqn: self.records[fqn] for fqn, proof in proofs.items()
                if fqn in self.records and self._same(fqn, proof, owners[fqn])}
        elsewhere = frozenset() if mine is None else frozenset(
            id(value) for fqn, value in kept.items() if fqn not in mine)
        return ReuseDecision(proofs, reused, frozenset(id(kept[fqn]) for fqn in reused), owners,
                             elsewhere_ids=elsewhere)

    def _proofs(self, live: Any) -> tuple[dict[str, Proof], dict[str, weakref.ref], dict[str, torch.Tensor]]:
        """Every frozen candidate of ``live`` by fqn: its proof now, its parameter, its tensor.
        A frozen tensor over ``SMALL_ITEM_BYTES`` is a candidate (an object of its own); the
        smaller ones are candidates together (one packed object) when they add up to
        ``PACK_MIN_BYTES``: below that, a pack and its second copy would cost two more files
        per save that rewrites them and save a few KiB."""
        frozen = self._frozen_params()
        flat, _ = flatten_state_dict(live)
        proofs: dict[str, Proof] = {}
        owners: dict[str, weakref.ref] = {}
        kept: dict[str, torch.Tensor] = {}
        small = 0
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                continue
            local = _local(value)
            param = frozen.get(local.data_ptr()) if local.numel() else None
            if param is None:
                continue
            mine = _local(param)
            if mine.numel() != local.numel() or mine.dtype != local.dtype \
                    or mine.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
                continue  # a view of part of it, or another tensor: no proof
            nbytes = local.numel() * local.element_size()
            small += nbytes if nbytes <= SMALL_ITEM_BYTES else 0
            proofs[fqn] = Proof(id(param), _versions(param), local.data_ptr(), nbytes, local.dtype,
                                tuple(local.shape))
            owners[fqn] = weakref.ref(param)
            kept[fqn] = value
        if small < PACK_MIN_BYTES:
            for fqn in [f for f, proof in proofs.items() if proof.nbytes <= SMALL_ITEM_BYTES]:
                del proofs[fqn], owners[fqn], kept[fqn]
        return proofs, owners, kept

    def _same(self, fqn: str, proof: Proof, owner: weakref.ref) -> bool:
        recorded = self.owners.get(fqn)
        if recorded is None or recorded() is None or recorded() is not owner():
            return False  # another parameter object: its history is unknown
        return all(r.proof == proof for r in self.records[fqn].values())

    def settle(self, reuse: ReuseDecision, fingerprint: str, next_update: int, committed: bool) -> None:
        """A save's outcome (its save thread): a committed generation newer than the records'
        becomes the reference for the next saves."""
        if not committed:
            return
        records = {**reuse.reused, **reuse.written}
        with self._lock:
            if next_update <= self.update:
                return
            self.update = next_update
            self.fingerprint = fingerprint
            self.records = records
            self.owners = {fqn: reuse.owners[fqn] for fqn in records if fqn in reuse.owners}


    @torch.no_grad()
    def seed(self, live: Any, fingerprint: str, metadata: Metadata, manifest: Manifest,
             present: Callable[[FileEntry], bool]) -> int:
        """Main thread, after ``restore()`` loaded ``manifest``'s generation into ``live``:
        each frozen candidate whose every chunk there is a shared object the save target
        holds (``present``) was just loaded from those bytes (verified), so its history
        starts at the load: the next save references the objects instead of writing them
        again. Returns how many tensors were seeded."""
        proofs, owners, kept = self._proofs(live)
        records: dict[str, dict[Chunk, Record]] = {}
        for fqn, proof in proofs.items():
            chunks = _object_chunks(fqn, proof, metadata, manifest, present)
            mine = _own_chunk(kept[fqn])
            # only where this rank's shard is one of the saved chunks did the load copy one
            # object's bytes into it whole (another world size or sharding: written in full)
            if chunks and chunks.get(tuple(mine.offsets)) is not None \
                    and chunks[tuple(mine.offsets)].sizes == tuple(mine.sizes):
                records[fqn] = chunks
        with self._lock:
            self.update = manifest.next_update
            self.fingerprint = fingerprint
            self.records = records
            self.owners = {fqn: owners[fqn] for fqn in records}
        return len(records)


def _own_chunk(tensor: torch.Tensor) -> ChunkStorageMetadata:
    if isinstance(tensor, DTensor):
        return _create_chunk_from_dtensor(tensor)
    return _create_chunk_from_tensor(tensor)


def _object_chunks(fqn: str, proof: Proof, metadata: Metadata, manifest: Manifest,
                   present: Callable[[FileEntry], bool]) -> dict[Chunk, Record] | None:
    """The records of every chunk of ``fqn`` in ``metadata``, or None when one of them is not
    a shared object the target holds."""
    described = metadata.state_dict_metadata.get(fqn)
    if not isinstance(described, TensorStorageMetadata):
        return None
    chunks: dict[Chunk, Record] = {}
    for chunk in described.chunks:
        index = MetadataIndex(fqn, chunk.offsets)
        info = metadata.storage_data.get(index) if metadata.storage_data else None
        entry = manifest.file(dcp_entry_path(info.relative_path)) if isinstance(info, _StorageInfo) else None
        if entry is None or not is_object_path(entry.path) or not present(entry):
            return None
        result = WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
        chunks[tuple(chunk.offsets)] = Record(proof, tuple(chunk.sizes), result,
                                              entry.model_dump(exclude_none=True))
    return chunks


def split_plan(plan: SavePlan, reuse: ReuseDecision) -> tuple[SavePlan, set[MetadataIndex],
                                                           list[WriteResult], list[dict]]:
    """The items to write, the object items among them, and the reused items' write results
    and manifest entries (save thread)."""
    to_write: list[WriteItem] = []
    objects: set[MetadataIndex] = set()
    results: list[WriteResult] = []
    entries: dict[str, dict] = {}
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None or fqn not in reuse.proofs:
            to_write.append(item)
            continue
        chunk = item.tensor_data.chunk
        if fqn in reuse.reused:
            record = reuse.reused[fqn].get(tuple(chunk.offsets))
            if record is None or record.sizes != tuple(chunk.sizes):
                # never written from the live tensor (it was not staged): fail the save
                raise StagingError(f"{fqn}: the reused object does not cover chunk "
                                   f"{tuple(chunk.offsets)} of this save's plan")
            results.append(dataclasses.replace(record.result, index=item.index))
            entries[record.entry["path"]] = record.entry
            continue
        to_write.append(item)
        objects.add(item.index)
    return dataclasses.replace(plan, items=to_write), objects, results, list(entries.values())


def object_file_name(prefix: str, index: int) -> str:
    """Where the DCP writer puts an object item (relative to ``dcp/``): the attempt's
    ``objects/`` directory, under a name ``name_objects`` replaces with the digest."""
    return f"../{OBJECTS_DIR}/{NEW_OBJECT_PREFIX}{prefix}{index}.distcp"


def name_objects(local_dir: str, results: list[WriteResult], digests: dict[str, tuple[int, str]],
                 algorithm: str, rank: int, reuse: ReuseDecision,
                 sizes_of: Callable[[MetadataIndex], tuple[tuple[int, ...], tuple[int, ...]]]
                 ) -> tuple[list[WriteResult], list[dict]]:
    """Rename each new object file to its digest's name, point its write result there, and
    record it in ``reuse.written``; returns the results and the objects' manifest entries."""
    out: list[WriteResult] = []
    entries: dict[str, dict] = {}
    named: dict[str, tuple[str, dict]] = {}  # file name -> (DCP's relative path, entry)
    objects_dir = os.path.join(local_dir, OBJECTS_DIR)
    for result in results:
        info = result.storage_data
        name = os.path.basename(info.relative_path)
        if not (isinstance(info, _StorageInfo) and name.startswith(NEW_OBJECT_PREFIX)):
            out.append(result)
            continue
        if name not in named:  # a pack holds several items: renamed once
            size, digest = digests[name]
            path = object_path(digest)
            os.replace(os.path.join(objects_dir, name), os.path.join(local_dir, path))
            # one string per file: .metadata's pickle then holds it once, not once per item
            named[name] = (f"{DCP_OBJECT_PREFIX}{os.path.basename(path)}",
                           {"path": path, "size": size, algorithm: digest, "rank": rank})
        relative_path, entry = named[name]
        result = dataclasses.replace(
            result, storage_data=dataclasses.replace(info, relative_path=relative_path))
        out.append(result)
        entries[entry["path"]] = entry
        fqn = result.index.fqn
        offsets, chunk_sizes = sizes_of(result.index)
        reuse.written.setdefault(fqn, {})[offsets] = Record(reuse.proofs[fqn], chunk_sizes, result, entry)
    return out, list(entries.values())


def open_ledger(config: Any, state: Any, *, single_copy: bool, shares_objects: bool) -> ReuseLedger | None:
    """The manager's ledger: None unless ``incremental`` and the save target holds one copy of
    each generation on a tier that keeps shared objects."""
    if not config.incremental:
        return None
    if not (single_copy and shares_objects):
        log.info("incremental saves are off here: the save target keeps one copy per node or "
                 "no shared objects (docs/incremental.md)")
        return None
    return ReuseLedger(state.model, state.optimizer, full_every=config.reuse_full_every)


def settling(ledger: ReuseLedger | None, reuse: ReuseDecision | None, fingerprint: str,
             next_update: int, then: Callable[[Any], None]) -> Callable[[Any], None]:
    """A save job's ``on_done``: the ledger learns the outcome, then ``then(job)`` runs."""
    if ledger is None or reuse is None:
        return then

    def on_done(job: Any) -> None:
        try:
            ledger.settle(reuse, fingerprint, next_update, job.committed)
        finally:
            then(job)
    return on_done


def seed_after_restore(ledger: ReuseLedger | None, state: Any, result: Any, target: Any) -> int:
    """Main thread, at the end of ``restore()`` (every rank, for itself): seed the ledger
    from the generation just loaded when it came from the save target itself and is its
    newest (the records must stay referenced by a generation retention keeps); returns the
    number of tensors seeded."""
    manifest, metadata = getattr(result, "manifest", None), getattr(result, "metadata", None)
    if ledger is None or manifest is None or metadata is None or result.tier != target.kind:
        return 0
    store = target.store
    try:
        newer = [n for n in store.listdir("") if (parse_generation(n) or -1) > manifest.next_update
                 and store.exists(f"{n}/{MANIFEST_NAME}")]
    except (OSError, StorageError):
        return 0
    if newer:
        return 0

    def present(entry: FileEntry) -> bool:
        try:
            return store.size(entry.path) == entry.size
        except (OSError, StorageError):
            return False

    live = state.tensor_state()
    return ledger.seed(live, layout_fingerprint(live), metadata, manifest, present)
