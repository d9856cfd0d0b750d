"""``CheckpointManager.restore``: choose, vet and load the generation a job resumes from.

Call order (all ranks, main thread, on the checkpoint group): ``select_generation`` (every
rank agrees on the generation and the rejections; a generation with one damaged or missing
file is first repaired from another tier's copy of the same save, ``restore/repair.py``, and
validated again); a signing key that rejects everything
stops here; the leader of each filesystem group moves rejected generations newer than the
chosen one aside; rank 0 checks the latest pointer (broadcast); ``load_generation`` and one
all-gather of its verdict: a file that changed after validation (on any rank) is repaired
and the same generation loaded again, or, with no good copy, rejects that generation and the
next one is selected and loaded, within the same call; rank 0 logs the
outcome; every rank tells the launcher where it resumed from.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable

from torch.distributed.checkpoint import CheckpointException

from .. import faults, logs, runinfo
from ..context import Context
from ..errors import (
    NoValidGeneration,
    RestoreError,
    RestoreRefused,
    StorageError,
    UnsafeFileError,
    UntrustedGenerations,
    ValidationError,
)
from ..format.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    read_latest_pointer,
)
from ..format.validate import Problem
from ..storage.base import read_bounded
from ..tiers.base import CommitTier
from . import quarantine
from .loader import AgreedProblem, RestoreResult, load_generation, missing_file, select_generation
from .repair import Repairer

log = logs.get("dist_ckpt.manager")


def resume(ctx: Context, components: Iterable[str] | None,
           allow_contract_change: bool | None, verify_digests: bool,
           on_all_rejected: str | None = None) -> RestoreResult:
    tiers = ctx.tiers.newest_first()
    repair = Repairer(ctx.comm, ctx.tiers, ctx.config.signing_key)
    # with digests on, the shards are hashed by the load itself: every byte is read once
    select = functools.partial(select_generation, ctx.comm, tiers, digests=verify_digests,
                               key=ctx.config.signing_key, shards_on_load=verify_digests,
                               repair=repair)
    name, manifest, tier, rejected = select()
    faults.hit("restore.selected", ctx.comm.rank)
    if name is None and rejected and all(p.signature for p in rejected) \
            and ctx.config.key_rejects_all_raises:
        raise UntrustedGenerations(
            f"the signing key rejects every generation under {ctx.config.root} "
            f"({len(rejected)}; first: {rejected[0]}); a fresh start would discard them")
    fresh_ok = (on_all_rejected or ctx.config.on_all_rejected) == "fresh" or (
        bool(rejected) and all(p.signature for p in rejected) and ctx.config.on_key_rejects_all == "fresh")
    if name is None and not fresh_ok:
        refuse_fresh_start(ctx, rejected)  # before anything is moved aside: the next start sees them too
    quarantine.move_blocking(ctx.comm, ctx.tiers.root, rejected, name)
    notes = ctx.comm.broadcast(pointer_warnings(ctx) if ctx.comm.rank == 0 else None)
    allow = ctx.config.allow_contract_change if allow_contract_change is None \
        else allow_contract_change
    wanted = ctx.state.components if components is None else components
    result, late = None, []
    while name is not None and manifest is not None and tier is not None:
        faults.hit("restore.before_load", ctx.comm.rank)
        result, problem = _load_agreed(ctx, tier, name, manifest, wanted, allow, verify_digests)
        if problem is None:
            break
        if repair(tier, problem):  # the same generation from the same tier, now whole
            continue
        # its bytes changed after validation: rejected like any other, and the next one tried
        late.append(problem)
        name, manifest, tier, more = select(skip=frozenset((p.generation, p.tier or "") for p in late))
        late += more
    if name is None and late and not fresh_ok:
        refuse_fresh_start(ctx, rejected + late)
    if late:
        rejected += late
        quarantine.move_blocking(ctx.comm, ctx.tiers.root, late, name)
    if result is None or tier is None:
        result = RestoreResult(rejected=rejected, warnings=notes)
        resumed_from = None
    else:
        result.rejected, result.warnings = rejected, notes + result.warnings
        resumed_from = name
        result.tier = tier.kind
    result.repaired = list(repair.repaired)
    if ctx.comm.rank == 0:
        log_restore(result, f"{tier.url} ({tier.kind} tier)"
                           if resumed_from is not None and tier is not None else None)
    runinfo.report(ctx.comm.rank, resumed_from=resumed_from, next_update=result.next_update,
                   resumed_tier=result.tier, repaired=result.repair_summary,
                   rejected=[str(p) for p in rejected])
    return result


def _load_agreed(ctx: Context, tier: CommitTier, name: str, manifest: Manifest,
                 components: Iterable[str], allow: bool, one_pass: bool
                 ) -> tuple[RestoreResult | None, Problem | None]:
    """``load_generation`` on every rank, then one all-gather: a shard that fails its digest
    (``one_pass``: hashed by the load) or a file that changed after validation, on any rank,
    fails the generation on all of them (never a mixed load)."""
    result, problem, failure = None, None, None
    try:
        result = load_generation(
            ctx.comm, tier, ctx.state, name, manifest, components, allow_contract_change=allow,
            strict_torch_version=ctx.config.strict_torch_version, scratch_parent=ctx.config.cache_dir,
            one_pass=one_pass)
    except AgreedProblem as exc:  # agreed before the load began: every rank is here
        # this rank's url of the tier, as below: the next selection skips by it on every rank
        problem = dataclasses.replace(exc.problem, tier=tier.url)
        return None, problem
    except RestoreRefused:  # agreed before the load began: every rank raises it
        raise
    except ValidationError as exc:
        problem = Problem(name, str(exc), exc.path, tier=tier.url)
    except OSError as exc:  # a file this rank reads is absent from this tier's copy (a node-local
        # copy holds its node's ranks' files: ranks placed on other nodes than before miss theirs)
        problem = missing_file(name, tier, exc)
    except (CheckpointException, Exception) as exc:  # noqa: BLE001 - re-raised below, after the all-gather
        failure = exc
    # every rank reaches this all-gather, whatever its load raised: one rank leaving restore
    # early would leave the others blocked in it
    why = None if failure is None else f"{type(failure).__name__}: {failure}"
    verdicts = ctx.comm.all_gather((problem, why))
    failed = {rank: why for rank, (_, why) in enumerate(verdicts) if why is not None}
    if failed:  # the same error on every rank, chained to its own cause where it failed
        raise RestoreError(f"loading {name} failed on rank(s) {sorted(failed)}",
                           failures=failed) from failure
    problems = [p for p, _ in verdicts if p is not None]
    if not problems:
        return result, None
    # this rank's url of the tier: a node-local tier (memory) has one per node, and the next
    # selection skips by it on every rank alike
    problems[0].tier = tier.url
    return None, problems[0]


def refuse_fresh_start(ctx: Context, rejected: list[Problem]) -> None:
    """Every rank, with the same agreed rejections: raise :class:`NoValidGeneration` when
    they include a committed generation (a directory without a manifest is no progress of
    the run: starting without it is no loss). Rank 0 logs each rejection once."""
    committed = [p for p in rejected if p.committed]
    if not committed:
        return
    if ctx.comm.rank == 0:
        for problem in committed:
            log.error("rejected generation %s", problem)
    runinfo.report(ctx.comm.rank, rejected=[str(p) for p in rejected])
    raise NoValidGeneration(ctx.config.root, [str(p) for p in committed])


def pointer_warnings(ctx: Context) -> list[str]:
    """Rank 0: a latest pointer that is corrupt, names a missing generation or does not match
    its manifest is worth a warning (restore never trusts the pointer, but a person reading
    the root does)."""
    store, root = ctx.tiers.root.store, ctx.config.root
    chosen = "the generation was chosen by validation, as always"
    try:
        pointer = read_latest_pointer(store)
    except (FileNotFoundError, StorageError):
        return []
    except UnsafeFileError as exc:  # never a FIFO or a link
        return [f"{LATEST_NAME} under {root} is unusable ({exc}); {chosen}"]
    except ValidationError as exc:  # not a pointer, or names no generation
        return [f"{LATEST_NAME} under {root} is corrupt ({type(exc).__name__}); {chosen}"]
    try:
        manifest_raw = read_bounded(store, f"{pointer.generation}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    except UnsafeFileError as exc:
        return [f"{LATEST_NAME} under {root} is corrupt ({type(exc).__name__}); {chosen}"]
    except (FileNotFoundError, StorageError, OSError):
        return [f"{LATEST_NAME} points at {pointer.generation}, which is missing under {root}"]
    if hashlib.sha256(manifest_raw).hexdigest() != pointer.manifest_sha256:
        return [f"{LATEST_NAME} under {root} does not match the manifest of {pointer.generation} "
                "(damaged pointer or replaced manifest); the generation was chosen by validation"]
    return []


def log_restore(result: RestoreResult, tier: str | None) -> None:
    for problem in result.rejected:
        log.warning("rejected generation %s", problem)
    for warning in result.warnings:
        log.warning("%s", warning)
    if result.generation is None:
        log.info("restore: no generation validates; fresh start (%d rejected)", len(result.rejected))
    else:
        repaired = result.repair_summary
        log.info("restored %s (next_update %d) from %s; %d rejected%s", result.generation,
                 result.next_update, tier, len(result.rejected), f"; {repaired}" if repaired else "")
