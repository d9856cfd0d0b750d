"""What each rank knows before a save may start, and the all-gather that shares it.

Call order (all ranks, main thread, inside ``CheckpointManager.save``): ``gather_start`` ->
(an eager save copies into a free staging slot meanwhile: ``save.staging.stage_ahead``) ->
``gathered``. Every rank then runs the same checks on the same list (``save/agreement.py``,
``save/space.py``), so all ranks raise the same error or none. Only rank 0 looks for an
existing generation and picks the attempt id.
"""

from __future__ import annotations

import uuid

from .. import logs
from ..context import Context
from ..errors import CommitError
from ..format.inventory import inspect_generation
from ..format.manifest import MANIFEST_NAME, REJECTED_MARKER_PREFIX
from ..protocol.comm import PendingGather
from ..protocol.messages import SaveFacts, SpaceFacts
from ..storage.local import free_bytes
from . import agreement
from .inflight import InFlight
from .planning import SavePlanCache

log = logs.get(__name__)


def gather_start(ctx: Context, inflight: InFlight, plans: SavePlanCache, name: str,
                 fingerprint: str, reused_bytes: int = 0) -> PendingGather:
    """Start the all-gather (all ranks) of this rank's ``SaveFacts`` for generation ``name``;
    :func:`gathered` waits for every rank's. ``reused_bytes``: what this save references
    instead of writing (incremental), which needs no space."""
    is_root = ctx.comm.rank == 0
    facts = SaveFacts(
        busy=len(inflight) >= ctx.config.max_in_flight,
        errors=inflight.unraised(),
        boundary=ctx.state.at_optimizer_boundary(),
        cached=fingerprint == plans.fingerprint,
        space=_space_facts(ctx, inflight, plans, fingerprint, reused_bytes),
        extras=agreement.extras_digests(ctx.state.extras),
        exists=_existing(ctx, name) if is_root else None,
        attempt_id=uuid.uuid4().hex[:8] if is_root else None,
    )
    return ctx.comm.all_gather_start(facts)


def gathered(ctx: Context, name: str, pending: PendingGather) -> list[SaveFacts]:
    """Every rank's facts, in rank order; a peer lost meanwhile fails the save."""
    try:
        return pending.wait()
    except RuntimeError as exc:  # gloo: a peer died or broke off during the agreement
        peers = {rank: "did not complete the save agreement (this or another peer failed)"
                 for rank in range(ctx.comm.world_size) if rank != ctx.comm.rank}
        raise CommitError(f"{name} was not saved: the save agreement failed ({exc})",
                          generation=name, failures=peers) from exc


def _existing(ctx: Context, name: str) -> str | None:
    """Rank 0: None when ``name`` can be saved, else why not (committed, or present but
    invalid: a generation restore did not see or could not move aside)."""
    store = ctx.tiers.root.store
    if not store.exists(f"{name}/{MANIFEST_NAME}"):
        return None
    info = inspect_generation(store, name, digests=False, key=ctx.config.signing_key)
    if info.state == "committed":
        return "is already committed"
    if (info.path or "").startswith(REJECTED_MARKER_PREFIX):
        return None  # rejected, its move aside cut short: the tier's publish finishes it
    return (f"is present but invalid ({info.reason}); move it aside with "
            f"`dist-ckpt quarantine {ctx.config.root} {name}` (restore() does this for "
            f"generations newer than the one it loads)")


def _space_facts(ctx: Context, inflight: InFlight, plans: SavePlanCache,
                 fingerprint: str, reused_bytes: int) -> SpaceFacts | None:
    # the first save of a layout has no plan yet: it is not checked (an ENOSPC during the
    # write still fails it cleanly), later saves know exactly what each rank writes
    if not ctx.config.check_free_space or fingerprint != plans.fingerprint:
        return None
    free = None
    write_root = ctx.tiers.target.local_root
    if ctx.is_fs_leader:
        try:
            free = free_bytes(write_root)
        except OSError as exc:  # unmeasurable: this group is not checked, peers not stalled
            log.warning("cannot measure free space under %s: %s", write_root, exc)
    # saves in flight whose files are not written yet will still take their share
    per_save = max(0, (plans.plan_bytes or 0) - reused_bytes)
    return SpaceFacts(leader=ctx.comm.fs_leader, bytes=per_save * (1 + inflight.unwritten()), free=free)
