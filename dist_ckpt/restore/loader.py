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

from .. import faults
from ..errors import (
    SignatureError,
    StorageError,
    TorchVersionMismatch,
    UncommittedGeneration,
    ValidationError,
    per_rank,
    refusal_details,
    refused_error,
)
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
from .onepass import OnePassReader, own_shards, scratch_optimizer_state
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
                              signature=isinstance(exc, SignatureError),
                              committed=not isinstance(exc, UncommittedGeneration))
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
    written). The checks a rank can fail alone run before any collective of the load and end
    in one agreement (:func:`agree_before_load`)."""
    wanted = tuple(c for c in state.components if c in set(components))
    result = RestoreResult(next_update=manifest.next_update, tokens_seen=manifest.tokens_seen,
                           generation=name, manifest=manifest, components=wanted)
    prebuilt: list[torch.Tensor] = []

    def template_for(metadata: Metadata) -> dict:
        _check_fit(name, manifest, state, wanted, result, allow_contract_change, strict_torch_version)
        result.metadata = metadata
        prebuilt.extend(optim_targets.prebuild(state, metadata, wanted))
        return state.tensor_state(wanted)

    try:
        template = _dcp_load(comm, tier, name, manifest, template_for, scratch_parent, one_pass,
                             fresh_optimizer=lambda: bool(prebuilt))
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


def _check_fit(name: str, manifest: Manifest, state: TrainState, wanted: tuple[str, ...],
               result: RestoreResult, allow_contract_change: bool, strict_torch_version: bool) -> None:
    """This rank's checks that the generation fits the job: components, contract, torch."""
    missing = [c for c in wanted if c not in manifest.components]
    if missing:
        raise ValidationError(f"{name} holds no {missing} state", generation=name)
    result.contract_changes = contract_mod.check(manifest.contract, state.contract_spec,
                                                 allow_change=allow_contract_change,
                                                 saved_values=manifest.contract_values)
    if manifest.torch_version != torch.__version__:
        message = (f"{name} was saved by torch {manifest.torch_version}, this is torch "
                   f"{torch.__version__}; DCP does not promise cross-version compatibility")
        if strict_torch_version:
            raise TorchVersionMismatch(message)
        warnings.warn(message, stacklevel=4)
        result.warnings.append(message)


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


class AgreedProblem(Exception):
    """Every rank: a rank could not read the generation before the load began (a file
    missing or damaged: repair or the next generation answers it). Raised on every rank
    alike, after the agreement, so no rank gathers again."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


@dataclass(frozen=True)
class _Refusal:
    """What one rank reports to the agreement before the load."""

    kind: str  # the class name of what it raised
    reason: str
    problem: Problem | None  # set when repair or the next generation can answer it
    permanent: bool
    details: dict[str, Any]  # a mismatch's attributes (``errors.refusal_details``)


def agree_before_load(comm: Comm, tier: CommitTier, name: str, failure: BaseException | None) -> None:
    """All ranks, once each, after their own checks and before any collective of the load:
    one all-gather of every rank's refusal. Returns when none refused; otherwise raises the
    same error on every rank: :class:`RestoreRefused` (or its mismatch subclass) when any
    rank refused for a reason repair cannot answer, else :class:`AgreedProblem` with the
    lowest rank's problem. A rank that refused alone and returned would leave its peers
    blocked in DCP's first gather until the group's timeout."""
    from ..runinfo import PERMANENT_ERRORS  # runinfo imports errors only; no cycle at use

    mine = None
    if failure is not None:
        problem = None
        if isinstance(failure, ValidationError):
            problem = Problem(name, str(failure), failure.path, tier=tier.url)
        elif isinstance(failure, OSError):
            problem = missing_file(name, tier, failure)
        mine = _Refusal(type(failure).__name__, str(failure), problem,
                        isinstance(failure, PERMANENT_ERRORS), refusal_details(failure))
    verdicts = comm.all_gather(mine) if comm.distributed else [mine]
    refused = {rank: v for rank, v in enumerate(verdicts) if v is not None}
    if not refused:
        return
    hard = {rank: v for rank, v in refused.items() if v.problem is None}
    if not hard:
        raise AgreedProblem(refused[min(refused)].problem) from failure  # type: ignore[arg-type]
    raise refused_error(name, {r: f"{v.kind}: {v.reason}" for r, v in hard.items()},
                        {r: v.kind for r, v in hard.items()},
                        permanent=any(v.permanent for v in hard.values()),
                        details=hard[min(hard)].details) from failure


def missing_file(name: str, tier: CommitTier, exc: OSError) -> Problem:
    """A file the load could not read, named by its path in the generation where it can be."""
    filename, marker = str(exc.filename or ""), f"{name}/"
    path = filename.split(marker, 1)[1] if marker in filename else None
    return Problem(name, f"{type(exc).__name__}: {exc.strerror or exc}", path, tier=tier.url)


def _dcp_load(comm: Comm, tier: CommitTier, name: str, manifest: Manifest,
              template_for: Callable[[Metadata], dict], scratch_parent: str | None,
              one_pass: bool, fresh_optimizer: Callable[[], bool] = lambda: False) -> dict:
    """DCP load (all ranks) into the template ``template_for`` builds from the generation's
    metadata, which it returns. Opening the reader, the metadata, ``template_for`` (the
    fit checks) and the layout check are agreed on before ``dcp.load``; a verification
    failure during the load, on any rank, becomes one ``ValidationError`` naming each
    failing rank's file."""
    reader: GenerationReader | None = None
    verifying: OnePassReader | None = None
    try:
        failure: BaseException | None = None
        try:
            faults.hit("restore.read", comm.rank)
            reader = tier.open_reader(name, manifest, scratch_parent)
            if one_pass or reader.needs_local_copy:  # hashed while DCP plans: the rank's own shards
                verifying = OnePassReader(reader, comm, name, manifest)
                verifying.prefetch(own_shards(manifest, comm.rank))
            metadata = reader.read_metadata()
            template = template_for(metadata)
            check_layout(name, metadata, template)  # before anything is written into
            if verifying is not None:  # its optimizer state loads early, into tensors not the job's
                verifying.scratch = scratch_optimizer_state(template, fresh=fresh_optimizer())
        except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
            failure = exc
        agree_before_load(comm, tier, name, failure)
        assert reader is not None
        storage_reader = verifying if verifying is not None else reader.storage_reader
        try:
            if comm.distributed:
                dcp.load(template, storage_reader=storage_reader, process_group=comm.group)
            else:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(template, storage_reader=storage_reader)
        except (CheckpointException, Exception) as exc:  # DCP wraps failures; surface ours as ours
            failed = verification_failures(exc, reader.errors, comm.rank)
            if not failed:
                raise
            first = failed[min(failed)]
            raise ValidationError(f"{name} could not be loaded: {per_rank(failed)}", generation=name,
                                  path=getattr(first, "path", None)) from exc
        return template
    finally:
        if verifying is not None:
            verifying.close()
        if reader is not None:
            reader.close()
