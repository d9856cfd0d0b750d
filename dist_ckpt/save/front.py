"""The save path's front on one rank: agreement, staging copy, plan, and the job's start.

Call order: every rank calls :meth:`SaveFront.save` with the same arguments at the same
optimizer boundary, from the thread that trains (``CheckpointManager.save`` and ``finish``
do). Inside it, on every rank:

1. the in-flight saves are reaped and the ``SaveFacts`` all-gather starts
   (``save/facts.py``); while the peers' facts arrive this rank copies its tensors into a
   staging slot (eager snapshot, when a slot is free);
2. the agreed facts decide: raise a failure not raised yet, refuse a rank mid gradient
   accumulation, refuse an existing generation, then skip or block on a save in flight
   (``in_flight_policy``) and agree again;
3. free space is checked, the copy finished (or begun lazily), the DCP plan taken from the
   cache or made, and a ``SaveJob`` started: a background thread for an asynchronous save,
   ``run_save`` in this thread for a synchronous one (``save/coordinator.py``).

The front holds no policy after the commit: the job's ``on_done`` hands every finished job
to the caller's ``finished(slot, job)`` (``lifecycle/after_commit.py``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

from .. import faults, logs
from ..context import Context
from ..errors import GenerationExists, NotAtOptimizerBoundary
from ..format.manifest import generation_name
from ..protocol.messages import SaveFacts
from ..restart import codec
from ..restart import contract as contract_mod
from ..version import __version__
from . import agreement, facts
from .coordinator import SaveJob, SaveRequest, run_save
from .inflight import InFlight
from .planning import PreparedSave, SavePlanCache, layout_fingerprint
from .request import ManifestInfo
from .reuse import ReuseDecision, ReuseLedger, settling
from .snapshot import LazySnapshots, PendingCopy, run_after_copy
from .space import check_space
from .staging import Staged, StagingPool, StagingSlot, stage_ahead

log = logs.get("dist_ckpt.manager")

Finished = Callable[[StagingSlot | None, SaveJob], None]


class SaveFront:
    """Starts this rank's saves; owns nothing it was given (the manager closes those)."""

    def __init__(self, ctx: Context, *, inflight: InFlight, plans: SavePlanCache,
                 staging: StagingPool | None, snapshots: LazySnapshots | None,
                 reuse: ReuseLedger | None, finished: Finished) -> None:
        self.ctx = ctx
        self.inflight = inflight
        self.plans = plans
        self.staging = staging
        self.snapshots = snapshots
        self.reuse = reuse
        self.finished = finished

    def bound_s(self) -> float:
        """The longest ``save`` may block: the oldest save in flight, then this one, each bounded."""
        return 2 * self.ctx.config.commit_timeout_s + 60

    def save(self, next_update: int, tokens_seen: int | None, *, may_skip: bool) -> SaveJob | None:
        """Start generation ``next_update`` (all ranks); None when the ``skip`` policy skipped it."""
        started = time.perf_counter()
        stats = self.inflight.stats
        stats.requested += 1
        live = self.ctx.state.tensor_state()
        fingerprint = layout_fingerprint(live)
        reuse = None if self.reuse is None else \
            self.reuse.decide(live, fingerprint, self.plans.written_fqns(fingerprint))
        name = generation_name(next_update)
        ahead: list[Staged] = []  # the eager copy, once made; released unless a job owns it
        try:
            agreed = self._agree(name, live, fingerprint, reuse, ahead, may_skip)
            if agreed is None:
                return None
            # once the in-flight bound allows the save: waiting or skipping comes first
            check_space(agreed, self.ctx.config.space_headroom_bytes, self.ctx.tiers.target.local_root)
            job = self._start(name, next_update, tokens_seen, live, fingerprint,
                              all(f.cached for f in agreed), agreed[0].attempt_id, started,
                              ahead[0] if ahead else None, reuse)
            ahead.clear()  # the job owns the slot now
        finally:
            if ahead:  # the save did not start: the copy is dropped
                self.staging.release(ahead[0].slot)  # type: ignore[union-attr]
        stats.last_blocking_s = job.blocking_s
        return job

    def _agree(self, name: str, live: dict, fingerprint: str, reuse: ReuseDecision | None,
               ahead: list[Staged], may_skip: bool) -> list[SaveFacts] | None:
        """The all-ranks agreement, repeated after each wait for the oldest save in flight;
        returns every rank's facts, or None when this save is skipped. Appends the eager copy
        to ``ahead`` when it made one."""
        ctx, inflight = self.ctx, self.inflight
        while True:
            inflight.reap()
            pending = facts.gather_start(ctx, inflight, self.plans, name, fingerprint,
                                         reuse.reused_bytes if reuse is not None else 0)
            if not ahead and self.snapshots is None and len(inflight) < ctx.config.max_in_flight:
                # the eager copy runs while the peers' facts arrive
                staged = stage_ahead(self.staging, live, pending, ctx.comm.rank,
                                     reuse.keeps_live if reuse is not None else None)
                if staged is not None:
                    ahead.append(staged)
            agreed = facts.gathered(ctx, name, pending)
            inflight.raise_agreed(sorted({g for f in agreed for g in f.errors}))
            if not all(f.boundary for f in agreed):
                ctx.state.check_boundary()
                raise NotAtOptimizerBoundary("another rank is mid gradient accumulation")
            agreement.check_extras(agreed)
            if agreed[0].exists is not None:
                raise GenerationExists(f"{name} {agreed[0].exists} under {ctx.config.root}")
            if not any(f.busy for f in agreed):
                return agreed
            if ctx.config.in_flight_policy == "skip" and may_skip:
                inflight.stats.skipped += 1
                log.warning("skipped save of %s: %d save(s) in flight", name, len(inflight))
                return None
            # block: wait for the oldest save, then agree again (its failure raises here)
            inflight.wait_oldest()

    def _stage(self, live: dict, name: str, fingerprint: str, all_cached: bool, ahead: Staged | None,
               reuse: ReuseDecision | None) -> tuple[StagingSlot | None, PreparedSave, PendingCopy | None]:
        """This rank's staged copy (or, without staging, the live tensors) and its save plan;
        returns (slot, prepared plan, lazy copy still to run)."""
        rank = self.ctx.comm.rank
        if ahead is not None:
            slot = ahead.slot
        else:
            faults.hit("stage.before", rank)
            slot = self.staging.acquire() if self.staging is not None else None
        pending: PendingCopy | None = None
        try:
            if reuse is not None and not all_cached and reuse.stage_everything_written() \
                    and ahead is not None:
                ahead = Staged(ahead.slot, ahead.slot.stage(live, reuse.keeps_live))  # plans again
            if ahead is not None:
                staged = ahead.staged
            elif slot is None:
                staged = live
            elif self.snapshots is not None:
                staged, pending = self.snapshots.begin(slot, live, generation=name, rank=rank,
                                                       timeout_s=self.ctx.config.commit_timeout_s,
                                                       keep_live=reuse and reuse.keeps_live)
            else:
                staged = slot.stage(live, reuse and reuse.keeps_live)
            return slot, self.plans.prepare(staged, fingerprint, all_cached), pending
        except BaseException:
            if slot is not None:
                self.staging.release(slot)  # type: ignore[union-attr]
            raise

    def _request(self, name: str, next_update: int, attempt_id: str, prepared: PreparedSave,
                 reuse: ReuseDecision | None) -> SaveRequest:
        ctx, state = self.ctx, self.ctx.state
        is_root = ctx.comm.rank == 0
        return SaveRequest(
            generation=name, next_update=next_update, tokens_seen=state.tokens_seen,
            attempt=ctx.tiers.target.begin(name, attempt_id), prepared=prepared,
            signing_key=ctx.config.signing_key,
            digest_algorithm=ctx.config.digest_algorithm, reuse=reuse,
            rank_state=codec.dumps(state.rank_state()),
            global_state=codec.dumps(state.global_state()) if is_root else None,
            info=ManifestInfo(world_size=ctx.comm.world_size, components=list(state.components),
                              contract=state.contract,
                              contract_digest=contract_mod.digest(state.contract),
                              contract_values=state.contract_spec.values or None,
                              dist_ckpt_version=__version__) if is_root else None,
        )

    def _start(self, name: str, next_update: int, tokens_seen: int | None, live: dict,
               fingerprint: str, all_cached: bool, attempt_id: str, started: float,
               ahead: Staged | None, reuse: ReuseDecision | None) -> SaveJob:
        config, state = self.ctx.config, self.ctx.state
        state.next_update = next_update
        if tokens_seen is not None:
            state.tokens_seen = tokens_seen
        slot, prepared, pending = self._stage(live, name, fingerprint, all_cached, ahead, reuse)
        request = self._request(name, next_update, attempt_id, prepared, reuse)
        job = SaveJob(request, on_done=settling(self.reuse, reuse, fingerprint, next_update,
                                                functools.partial(self.finished, slot)))
        job.blocking_s = time.perf_counter() - started  # set before the background thread starts
        args = (job, self.ctx.comm, config.io_threads, config.commit_timeout_s)
        if config.async_save:
            job.thread = threading.Thread(target=run_after_copy,
                                          args=(pending, *args, config.background_nice),
                                          daemon=True, name=f"dist-ckpt-save-{name}")
            self.inflight.add(job)
            if pending is not None:
                self.snapshots.track(pending)  # type: ignore[union-attr]
            job.thread.start()
        else:
            run_save(*args)
            job.blocking_s = time.perf_counter() - started
            self.inflight.add(job)
            self.inflight.reap()
            self.inflight.raise_unraised()
        return job
