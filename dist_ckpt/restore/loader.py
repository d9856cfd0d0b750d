"""Restore: pick the newest generation that validates, then load it into live objects.

Call order (all ranks, main thread, on the checkpoint group):
``select_generation`` -- rank 0 lists generations and checks structure and sizes, then the
digest check is split across ranks and the verdicts all-gathered, so every rank agrees on
the same generation and the same rejections -- then ``load_generation``: contract and torch
version checks, DCP load with resharding (the pickled ``.metadata`` is read only after its
digest matched), global state, and RNG last.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import SignatureError, StorageError, TorchVersionMismatch, ValidationError, per_rank
from ..format.manifest import (
    COMMON_FILES,
    DCP_DIR,
    GLOBAL_STATE_FILE,
    METADATA_FILE,
    Manifest,
    is_object_path,
    parse_generation,
    rank_state_file,
)
from ..format.validate import (
    Problem,
    check_digests,
    check_sizes,
    check_structure,
    list_generations,
    read_verified,
)
from ..protocol.comm import Comm
from ..restart import codec, rng
from ..restart import contract as contract_mod
from ..restart.state import TrainState
from ..storage.base import StoreReader
from ..tiers.base import CommitTier, GenerationReader
from . import optim_targets
from .layout import check_layout
from .onepass import OnePassReader, own_shards
from .repair import RepairedFile, repair_summary


@dataclass
class RestoreResult:
    """What ``CheckpointManager.restore()`` did. ``generation`` is None for a fresh start."""

    next_update: int = 0
    tokens_seen: int = 0
    generation: str | None = None
    rejected: list[Problem] = field(default_factory=list)
    manifest: Manifest | None = None
    contract_changes: dict[str, tuple] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    components: tuple[str, ...] = ()
    tier: str | None = None  # the kind of tier it was loaded from ("memory", "local", ...)
    repaired: list[RepairedFile] = field(default_factory=list)  # files replaced by good copies
    # the loaded generation's DCP metadata (incremental saves start from what was loaded)
    metadata: Metadata | None = field(default=None, repr=False, compare=False)

    @property
    def repair_summary(self) -> str | None:
        """``repaired N file(s) of gen-... from <tier>``, or None."""
        return repair_summary(self.repaired)

    @property
    def fresh(self) -> bool:
        return self.generation is None


def select_generation(comm: Comm, tiers: list[CommitTier], *, digests: bool = True,
                     key: bytes | None = None, skip: frozenset[tuple[str, str]] = frozenset(),
                     shards_on_load: bool = False,
                     repair: Callable[[CommitTier, Problem], bool] | None = None
                     ) -> tuple[str | None, Manifest | None, CommitTier | None, list[Problem]]:
    """The newest generation that validates in any tier (local first, then the mirror); with
    ``key``, only signed manifests validate. ``skip`` holds (generation, tier url) pairs
    already rejected by this restore. ``shards_on_load``: the DCP shard files are hashed by
    the load itself (``OnePassReader``), so selection checks their sizes only. ``repair``
    (all ranks, with the agreed problem; ``restore/repair.py``): True when the file the
    problem names was replaced by a good copy, and the generation is validated again."""
    rejected: list[Problem] = []
    listings = comm.broadcast([_listing(t.store) for t in tiers] if comm.rank == 0 else None)
    names = sorted(set().union(*listings), key=parse_generation, reverse=True)
    for name in names:
        for tier, listing in zip(tiers, listings, strict=True):
            if name not in listing or (name, tier.url) in skip:
                continue
            verdict = validate_everywhere(comm, tier.store, name, digests=digests, key=key,
                                          shards_on_load=shards_on_load,
                                          same_world=not tier.reshards)
            while isinstance(verdict, Problem) and repair is not None and repair(tier, verdict):
                verdict = validate_everywhere(comm, tier.store, name, digests=digests, key=key,
                                              shards_on_load=shards_on_load,
                                              same_world=not tier.reshards)
            if isinstance(verdict, Problem):
                verdict.tier = tier.url
                rejected.append(verdict)
                continue
            return name, verdict, tier, rejected
    return None, None, None, rejected


def _listing(store: StoreReader) -> set[str]:
    try:
        return set(list_generations(store))
    except StorageError:
        return set()


def validate_everywhere(comm: Comm, store: StoreReader, name: str, *, digests: bool,
                         key: bytes | None, shards_on_load: bool = False,
                         same_world: bool = False) -> Manifest | Problem:
    """Rank 0 checks structure and sizes; the digest check is split across ranks (all of it,
    or, with ``shards_on_load``, all but the DCP shards, which the load hashes). ``same_world``
    (a tier that cannot reshard): a generation of another world size is rejected before any
    digest is computed, with that reason."""
    if comm.rank == 0:
        try:
            checked = check_structure(store, name, key=key)
            if not same_world:  # node copies: each rank checks its node's files below
                check_sizes(store, name, checked)
            verdict: str | Problem = checked.model_dump_json()
        except Exception as exc:  # noqa: BLE001 - any failure rejects it; peers wait on the broadcast
            verdict = Problem(name, _reason(exc), getattr(exc, "path", None),
                              signature=isinstance(exc, SignatureError))
    shared = comm.broadcast(verdict if comm.rank == 0 else None)
    if isinstance(shared, Problem):
        return shared
    manifest = Manifest.from_bytes(shared.encode(), generation=name)
    if same_world and manifest.world_size != comm.world_size:  # the same verdict on every rank
        return Problem(name, f"saved by {manifest.world_size} ranks, this job has "
                             f"{comm.world_size}: that tier restores only the same world size")
    problem = None
    if same_world:
        # a node's copy holds its ranks' files and the common ones: each rank checks its own,
        # each filesystem leader the common files (memory/ring.py completes the copies)
        mine = [f.path for f in manifest.files if f.rank == comm.rank
                or (f.path in COMMON_FILES and comm.rank == comm.fs_leader)]
    else:
        mine = [f.path for f in manifest.files][comm.rank :: comm.world_size]
    try:
        # DCP unpickles .metadata without restriction before it knows anything else: its
        # digest is checked even when the caller turned digests off (an opt-out for trusted
        # storage: shards' non-tensor items are unpickled without restriction too)
        hashed = set(mine) if digests else set(mine) & ALWAYS_HASHED
        if shards_on_load:
            hashed = {p for p in hashed if p in ALWAYS_HASHED
                      or not (p.startswith(f"{DCP_DIR}/") or is_object_path(p))}
        check_digests(store, name, manifest, hashed)
        # the rest of this rank's share by size (a node-local copy may lack other nodes'
        # files); a hashed file needs no size check: a missing or resized one fails its digest
        check_sizes(store, name, manifest.model_copy(
            update={"files": [f for f in manifest.files if f.path in set(mine) - hashed]}))
    except Exception as exc:  # noqa: BLE001 - reported through the all-gather, never raised alone
        problem = Problem(name, _reason(exc), getattr(exc, "path", None))
    problems = [p for p in comm.all_gather(problem) if p is not None]
    return problems[0] if problems else manifest


ALWAYS_HASHED = frozenset({METADATA_FILE})


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError | OSError):
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc}"


def load_generation(comm: Comm, tier: CommitTier, state: TrainState, name: str,
                    manifest: Manifest, components: Iterable[str], *,
                    allow_contract_change: bool, strict_torch_version: bool,
                    scratch_parent: str | None = None, one_pass: bool = False) -> RestoreResult:
    """Load generation ``name`` into ``state`` (all ranks). ``one_pass``: the shards were not
    hashed at selection; the load hashes them (every rank agrees before any tensor is
    written)."""
    wanted = tuple(c for c in state.components if c in set(components))
    missing = [c for c in wanted if c not in manifest.components]
    if missing:
        raise ValidationError(f"{name} holds no {missing} state", generation=name)
    result = RestoreResult(next_update=manifest.next_update, tokens_seen=manifest.tokens_seen,
                           generation=name, manifest=manifest, components=wanted)
    result.contract_changes = contract_mod.check(manifest.contract, state.contract,
                                                 allow_change=allow_contract_change)
    if manifest.torch_version != torch.__version__:
        message = (f"{name} was saved by torch {manifest.torch_version}, this is torch "
                   f"{torch.__version__}; DCP does not promise cross-version compatibility")
        if strict_torch_version:
            raise TorchVersionMismatch(message)
        warnings.warn(message, stacklevel=3)
        result.warnings.append(message)

    prebuilt: list[torch.Tensor] = []

    def template_for(metadata: Metadata) -> dict:
        result.metadata = metadata
        prebuilt.extend(optim_targets.prebuild(state, metadata, wanted))
        return state.tensor_state(wanted)

    try:
        template = _dcp_load(comm, tier, name, manifest, template_for, scratch_parent, one_pass)
    except BaseException:
        optim_targets.discard(state, prebuilt)  # the next candidate starts from no state
        raise
    store = tier.store
    state.load_tensor_state(template)

    raw_global = read_verified(store, name, manifest, GLOBAL_STATE_FILE, validated=True)
    saved_global = codec.loads(raw_global, what=f"{name}/{GLOBAL_STATE_FILE}")
    state.load_global_state(saved_global, wanted)
    if "rng" in wanted:  # last: constructing and loading must not consume restored streams
        if comm.rank < manifest.world_size:
            own = rank_state_file(comm.rank)
            saved_rank = codec.loads(read_verified(store, name, manifest, own, validated=True))
            state.load_rank_state(saved_rank)
        else:
            base = codec.loads(read_verified(store, name, manifest, rank_state_file(0), validated=True))
            state.load_rank_state({"rng": rng.derived(base["rng"], comm.rank)})
    return result


def verification_failures(exc: BaseException, errors: list[ValidationError], rank: int = 0
                          ) -> dict[int, ValidationError]:
    """The verification failures behind a failed ``dcp.load``, by rank (empty when ``exc`` is
    another failure). DCP wraps what each rank raised in a ``CheckpointException``
    (``failures``: rank -> (exception, traceback)), so ours are found there by type; the
    reader's ``errors`` (what it raised, which DCP may have rewrapped) stand for ``rank`` when
    DCP carries none for it. Catch ``CheckpointException`` explicitly: it is a BaseException."""
    failed = {r: failure for r, (failure, _) in getattr(exc, "failures", {}).items()
              if isinstance(failure, ValidationError)}
    if errors:
        failed.setdefault(rank, errors[0])
    return failed


def load_in_process(template: dict[str, Any], reader: GenerationReader) -> None:
    """``dcp.load`` into ``template`` in this process alone (the offline tools: no process
    group); a verification failure is raised as itself, not wrapped by DCP."""
    try:
        with warnings.catch_warnings():  # no process group is the point, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(template, storage_reader=reader.storage_reader, no_dist=True)
    except (CheckpointException, Exception) as exc:  # a BaseException; surface ours as ours
        failed = verification_failures(exc, reader.errors)
        if failed:
            raise failed[min(failed)] from exc
        raise


def _dcp_load(comm: Comm, tier: CommitTier, name: str, manifest: Manifest,
              template_for: Callable[[Metadata], dict], scratch_parent: str | None,
              one_pass: bool) -> dict:
    """DCP load (all ranks) into the template ``template_for`` builds from the generation's
    metadata, which it returns; a verification failure on any rank becomes one
    ``ValidationError`` naming each failing rank's file."""
    reader = tier.open_reader(name, manifest, scratch_parent)
    one_pass = one_pass or reader.needs_local_copy
    verifying = OnePassReader(reader, comm, name, manifest) if one_pass else None
    storage_reader = verifying if verifying is not None else reader.storage_reader
    try:
        if verifying is not None:  # hashed while DCP plans: the rank's own shards
            verifying.prefetch(own_shards(manifest, comm.rank))
        metadata = reader.read_metadata()
        template = template_for(metadata)
        check_layout(name, metadata, template)  # before anything is written into
        if comm.distributed:
            dcp.load(template, storage_reader=storage_reader, process_group=comm.group)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(template, storage_reader=storage_reader)
        return template
    except (CheckpointException, Exception) as exc:  # DCP wraps failures; surface ours as ours
        failed = verification_failures(exc, reader.errors, comm.rank)
        if not failed:
            raise
        first = failed[min(failed)]
        raise ValidationError(f"{name} could not be loaded: {per_rank(failed)}", generation=name,
                              path=getattr(first, "path", None)) from exc
    finally:
        if verifying is not None:
            verifying.close()
        reader.close()
