"""Rehearsal: prove a generation restorable into freshly built objects before trusting it.

Call order (all ranks, main thread, on a manager built around *fresh* objects, typically in a
separate job): ``CheckpointManager.rehearse(step_fn)`` picks the generation (the newest that
validates, or the one named), then checks, naming the component that fails:

1. ``contract``: the experiment contract (as restore does);
2. ``model`` / ``optimizer``: every tensor the fresh objects expect exists in the DCP metadata
   with the same global shape, and the checkpoint holds nothing the objects lack (optimizer
   state paired with the same parameters);
3. ``rng``: the saved per-rank RNG schema (sources, NumPy generator names) matches this job's;

then loads it for real (``load_generation``), runs ``step_fn(state) -> loss`` once, and
digests the updated tensors of every rank (all-gather). Rank 0 records the outcome in
``ROOT/rehearsals.json``; with ``CheckpointConfig(require_rehearsal=True)`` retention keeps
older generations until the newest committed one has passed.

A rehearsal passes only once an update ran on the restored state: without ``step_fn`` it
fails in ``update`` (after loading), and under ``dist-ckpt rehearse --script`` the record the
restore writes says the script has not trained yet until the script's next save records the
digest after at least one update (:func:`end_script_rehearsal`; a save at the generation's own
update records a failure). :func:`passed` also requires the digest of that update, so no
record of an older version unlocks retention without one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ..context import Context
from ..errors import DistCkptError, LayoutMismatch, StorageError, ValidationError
from ..format.manifest import Manifest, rank_state_file
from ..format.validate import read_verified
from ..restart import codec, rng
from ..restart import contract as contract_mod
from ..storage.base import Store
from ..tiers.base import CommitTier
from .layout import check_layout
from .loader import (
    load_generation,
    select_generation,
    validate_everywhere,
)

REHEARSALS_NAME = "rehearsals.json"
REHEARSE_ENV = "DIST_CKPT_REHEARSE"  # set by `dist-ckpt rehearse`: a generation name or "newest"
COMPONENT_OF_PREFIX = {"model": "model", "optim": "optimizer"}


class RehearsalFailed(DistCkptError):
    """A generation did not survive a rehearsal; ``component`` names what failed."""

    def __init__(self, generation: str, component: str, reason: str):
        super().__init__(f"rehearsal of {generation} failed in {component}: {reason}")
        self.generation = generation
        self.component = component
        self.reason = reason


@dataclass
class RehearsalResult:
    generation: str
    next_update: int
    loss: float | None = None
    digest: str | None = None  # sha256 over every rank's updated tensors (after step_fn)
    rejected: list[str] = field(default_factory=list)


NO_UPDATE = "no update ran on the restored state"


def rehearse(ctx: Context, generation: str | None, step_fn: Callable[[Any], float] | None,
             *, script: bool = False) -> RehearsalResult:
    """``script``: under ``dist-ckpt rehearse --script``, where the script's own training is
    the update; the outcome is recorded at its next save (:func:`end_script_rehearsal`)."""
    comm, config = ctx.comm, ctx.config
    name, manifest, tier, rejected = _choose(ctx, generation)
    try:
        _check(ctx, tier, name, manifest)
        try:
            load_generation(comm, tier, ctx.state, name, manifest, ctx.state.components,
                            allow_contract_change=config.allow_contract_change,
                            strict_torch_version=config.strict_torch_version,
                            scratch_parent=config.cache_dir)
        except (DistCkptError, KeyError, RuntimeError) as exc:
            raise RehearsalFailed(name, "load", f"{type(exc).__name__}: {exc}") from exc
        result = RehearsalResult(name, manifest.next_update, rejected=[str(p) for p in rejected])
        if script:
            _record(ctx, name, {"passed": False, "component": "update",
                                "reason": f"{NO_UPDATE}: the script has not reached its next save"})
            return result
        if step_fn is None:
            raise RehearsalFailed(name, "update", f"{NO_UPDATE} (loaded; rehearse() takes step_fn)")
        result.loss = float(step_fn(ctx.state))
        result.digest = _digest(ctx)
    except RehearsalFailed as failure:
        _record(ctx, name, {"passed": False, "component": failure.component, "reason": failure.reason})
        raise
    _record(ctx, name, {"passed": True, "loss": result.loss, "digest": result.digest, "updates": 1})
    return result


def _choose(ctx: Context, generation: str | None) -> tuple[str, Manifest, CommitTier, list]:
    tiers = ctx.tiers.persistent()
    key = ctx.config.signing_key
    if generation is None:
        name, manifest, tier, rejected = select_generation(ctx.comm, tiers, key=key)
        if name is None or manifest is None or tier is None:
            raise ValidationError(f"no generation under {ctx.config.root} validates; nothing to rehearse")
        return name, manifest, tier, rejected
    verdict = validate_everywhere(ctx.comm, ctx.tiers.root.store, generation, digests=True, key=key)
    if not isinstance(verdict, Manifest):
        raise RehearsalFailed(generation, "integrity", str(verdict))
    return generation, verdict, ctx.tiers.root, []


def _check(ctx: Context, tier: CommitTier, name: str, manifest: Manifest) -> None:
    """Every rank checks its own view; the first problem of any rank is raised everywhere."""
    problem: tuple[str, str] | None = None
    try:
        _check_contract(ctx, manifest)
        _check_tensors(ctx, tier, name, manifest)
        _check_rng(ctx, tier.store, name, manifest)
    except RehearsalFailed as failure:
        problem = (failure.component, failure.reason)
    problems = [p for p in ctx.comm.all_gather(problem) if p is not None]
    if problems:
        raise RehearsalFailed(name, *problems[0])


def _check_contract(ctx: Context, manifest: Manifest) -> None:
    try:
        contract_mod.check(manifest.contract, ctx.state.contract_spec,
                           allow_change=ctx.config.allow_contract_change,
                           saved_values=manifest.contract_values)
    except DistCkptError as exc:
        raise RehearsalFailed(manifest.generation, "contract", str(exc)) from exc
    missing = [c for c in ctx.state.components if c not in manifest.components]
    if missing:
        raise RehearsalFailed(manifest.generation, missing[0],
                              f"the generation holds no {missing} state but the job has one")


def _check_tensors(ctx: Context, tier: CommitTier, name: str, manifest: Manifest) -> None:
    reader = tier.open_reader(name, manifest, ctx.config.cache_dir)
    try:
        metadata = reader.read_metadata()
    finally:
        reader.close()
    try:
        check_layout(name, metadata, ctx.state.tensor_state())
    except LayoutMismatch as exc:
        if exc.missing:
            key, reason = exc.missing[0], f"{exc.missing[0]} is missing from the generation"
        elif exc.mismatched:
            key = sorted(exc.mismatched)[0]
            saved, current = exc.mismatched[key]
            reason = f"{key} has shape {saved} in the generation, {current} in the job"
        else:
            key = exc.unexpected[0]
            reason = (f"the generation holds {key} (and {len(exc.unexpected) - 1} more) that the "
                      "job's objects do not have")
        raise RehearsalFailed(name, COMPONENT_OF_PREFIX.get(key.split(".", 1)[0], "model"), reason) from exc


def _check_rng(ctx: Context, backend: Store, name: str, manifest: Manifest) -> None:
    rank = ctx.comm.rank if ctx.comm.rank < manifest.world_size else 0
    try:
        raw = read_verified(backend, name, manifest, rank_state_file(rank), validated=True)
        saved = codec.loads(raw)["rng"]
    except (DistCkptError, OSError, KeyError) as exc:
        raise RehearsalFailed(name, "rng", f"unreadable rank state: {exc}") from exc
    current = rng.capture(ctx.state.numpy_generators)
    if sorted(saved) != sorted(current):
        raise RehearsalFailed(name, "rng", f"saved sources {sorted(saved)}, the job has {sorted(current)}")
    if sorted(saved["numpy_generators"]) != sorted(current["numpy_generators"]):
        raise RehearsalFailed(name, "rng", f"saved NumPy generators {sorted(saved['numpy_generators'])}, "
                                           f"the job registers {sorted(current['numpy_generators'])}")


def _digest(ctx: Context) -> str:
    flat, _ = flatten_state_dict(ctx.state.tensor_state())
    local = hashlib.sha256()
    for key in sorted(flat):
        value = flat[key]
        if isinstance(value, torch.Tensor):
            tensor = value.to_local() if hasattr(value, "to_local") else value
            local.update(key.encode())
            local.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    combined = hashlib.sha256("".join(ctx.comm.all_gather(local.hexdigest())).encode())
    return combined.hexdigest()


def read_rehearsals(backend: Store) -> dict[str, dict[str, Any]]:
    try:
        loaded = json.loads(backend.read_bytes(REHEARSALS_NAME))
    except (FileNotFoundError, StorageError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def record_passed(record: dict[str, Any]) -> bool:
    """Whether a rehearsal record is a pass: restored, trained, digested after the update."""
    return bool(record.get("passed")) and bool(record.get("digest")) and record.get("updates", 1) >= 1


def passed(backend: Store, generation: str) -> bool:
    return record_passed(read_rehearsals(backend).get(generation, {}))


def _record(ctx: Context, name: str, outcome: dict[str, Any]) -> None:
    if ctx.comm.rank == 0:
        records = read_rehearsals(ctx.tiers.root.store)
        records[name] = {**outcome, "time_unix": time.time()}
        ctx.tiers.root.store.put_bytes(REHEARSALS_NAME, json.dumps(records, indent=1).encode())
    ctx.comm.barrier()  # every rank returns after the record is durable


def script_mode() -> str | None:
    """Under ``dist-ckpt rehearse --script``: the generation to rehearse ("newest" or a name)."""
    return os.environ.get(REHEARSE_ENV) or None


def end_script_rehearsal(ctx: Context, result: RehearsalResult, next_update: int) -> None:
    """All ranks, at the script's first save after the rehearsed restore: nothing is written;
    the updated state's digest is recorded and the process ends (exit 0 after at least one
    update; a save at the generation's own update records a failure and exits 1)."""
    updates = next_update - result.next_update
    if updates < 1:
        _record(ctx, result.generation, {
            "passed": False, "component": "update", "updates": updates,
            "reason": f"{NO_UPDATE}: the script saved at update {next_update}, the generation's own "
                      f"(let it run past update {next_update}, e.g. through --script-args)"})
        raise SystemExit(1)
    _record(ctx, result.generation, {"passed": True, "loss": None, "digest": _digest(ctx),
                                     "updates": updates})
    raise SystemExit(0)
