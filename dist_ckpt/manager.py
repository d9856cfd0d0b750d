"""``CheckpointManager``: the public face (save / wait / close / restore / generations).

Call order: construct on every rank after ``init_process_group`` (collective: it creates the
checkpoint gloo group); ``restore()`` on every rank before training; ``save(next_update)`` on
every rank at the same optimizer boundaries; ``wait()`` / ``close()`` on every rank at the end.
``save()`` runs one small all-gather on the checkpoint group so that all ranks agree on
errors to raise, skipping, and plan reuse; everything after the staging copy runs in the
background for an asynchronous save and coordinates only through the c10d store.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Literal

from . import faults, logs, marks, runinfo
from .config import CheckpointConfig
from .context import Context, Tiers
from .errors import (
    CommitError,
    ConfigError,
    GenerationExists,
    NotAtOptimizerBoundary,
)
from .format.inventory import GenerationInfo, inventory
from .format.manifest import generation_name
from .lifecycle import finish, retention
from .lifecycle.after_commit import AfterCommit
from .lifecycle.done import DoneRecord
from .lifecycle.finish import FinalStep
from .lifecycle.preemption import PreemptionWatch, stop_preempted
from .lifecycle.pruning import Pruner
from .lifecycle.replication import open_replayer
from .memory.runner import MemoryTierRunner
from .protocol.comm import Comm
from .protocol.messages import PINS_KEY
from .restart import codec
from .restart import contract as contract_mod
from .restart.state import TrainState
from .restore import rehearse as rehearsal
from .restore.loader import RestoreResult
from .restore.rehearse import RehearsalResult
from .restore.resume import resume
from .save import agreement, facts
from .save.coordinator import SaveJob, SaveRequest, run_save
from .save.inflight import InFlight, SaveStats
from .save.planning import PreparedSave, SavePlanCache, layout_fingerprint
from .save.request import ManifestInfo
from .save.reuse import ReusePlan, open_ledger, seed_after_restore, settling
from .save.schedule import SaveSchedule
from .save.snapshot import PendingCopy, lazy_snapshots, run_after_copy
from .save.space import check_space
from .save.staging import Staged, StagingPool, StagingSlot, stage_ahead
from .tiers import CommitTier, TierOptions, open_tier
from .tiers.placement import place_tiers
from .version import __version__

log = logs.get(__name__)
# managers not closed yet: closed at interpreter exit, before finalisation, so that no save
# thread is still running native code when the interpreter tears down (a crash, not an exit).
# Strong references: a manager the job dropped without close() still owns running threads
# (nothing else refers to it: the save threads hold only their jobs), and must still be
# closed here rather than vanish from a weak set.
_OPEN: set[CheckpointManager] = set()


@atexit.register
def _close_at_exit() -> None:
    for manager in list(_OPEN):
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - an unraised save failure: logged, the exit goes on
            log.exception("closing a CheckpointManager at interpreter exit")


class CheckpointManager:
    """Saves and restores the :class:`TrainState` of this rank under ``config.root``.

    A facade: the work is done by collaborators that receive a frozen :class:`Context`
    (comm, config, state, tiers), never the manager. ``inflight`` holds the saves in flight
    and the failures not raised yet; ``after_commit`` is what each committed generation goes
    through (log line, replay, pruning); ``memory`` runs the node memory tier; ``replayer``
    copies committed generations into the mirror (or memory into the root).
    """

    def __init__(self, config: CheckpointConfig, state: TrainState) -> None:
        self.config = config
        self.state = state
        self.snapshots = lazy_snapshots(config, state)  # None unless snapshot="lazy", async
        self.comm = Comm(timeout_s=3 * config.commit_timeout_s + 600)
        self._check_run_id()
        self.marks = marks.open_writer(runinfo.launch_dir(), self.comm.rank)
        self.preemption = PreemptionWatch(self.comm, runinfo.preempt_notice_path(),
                                          timeout_s=config.commit_timeout_s)
        # an object-store root's local scratch; this manager's own (no cache_dir) goes at close
        self._scratch = None if config.cache_dir else os.path.join(
            tempfile.gettempdir(), f"dist_ckpt-scratch-{self.comm.session}")
        root = open_tier(config.root, TierOptions(
            storage_options=dict(config.storage_options or {}),
            scratch_root=config.cache_dir or self._scratch,
            upload_verification=config.upload_verification, direct_io=config.direct_io,
            # a mirror holds every shared object once more, off this disk: no second copy then
            object_copies=config.object_copies if config.mirror is None else 1))
        # memory_tier: saves commit to this node's memory; the root is fed from it
        self.memory = MemoryTierRunner(config, root) if config.memory_tier else None
        self.tiers = Tiers(root=root, target=self.memory.tier if self.memory is not None else root,
                           mirror=self._open_mirror())
        self.ctx = Context(self.comm, config, state, self.tiers,
                           place_tiers(self.comm, config, root, self.tiers.target))
        if self.comm.rank == 0:
            try:
                # leaders of other nodes read the pins from the store (pins.json is on this node)
                self.comm.publish_names(PINS_KEY, retention.read_pins(root.store))
            except Exception:  # noqa: BLE001 - a corrupt pins.json stops pruning, not training
                log.exception("cannot read the pins under %s", config.root)
        self.pruner = Pruner(self.ctx, self.memory)
        self.replayer = open_replayer(self.ctx, self.memory, self.pruner)
        self.staging = StagingPool(config.max_in_flight) if config.async_save else None
        self.after_commit = AfterCommit(self.ctx, self.staging, self.memory, self.replayer, self.pruner)
        self.plans = SavePlanCache(self.comm)
        self.reuse = open_ledger(config, state, single_copy=len(self.comm.fs_group) == self.comm.world_size,
                                 shares_objects=self.tiers.target.shares_objects)
        self.inflight = InFlight(self.comm)
        self._closed = False
        self._rehearsal: RehearsalResult | None = None
        self.schedule = None if config.save_every is None else SaveSchedule(
            every=config.save_every, auto=config.cadence == "auto", mtbf_s=config.mtbf_s)
        _OPEN.add(self)
        runinfo.report(self.comm.rank, root=config.root, mirror=config.mirror,
                       world_size=self.comm.world_size, pid=os.getpid(), memory_tier=config.memory_tier,
                       contract_digest=contract_mod.digest(state.contract))

    @property
    def stats(self) -> SaveStats:
        return self.inflight.stats

    def _open_mirror(self) -> CommitTier | None:
        config = self.config
        if config.mirror is None:
            return None
        return open_tier(config.mirror, TierOptions(
            storage_options=dict(config.storage_options or {}),
            concurrency=config.mirror_concurrency, upload_verification=config.upload_verification,
            direct_io=config.direct_io))

    def _check_run_id(self) -> None:
        # launchers of different nodes that disagree on the run would mix two runs' shards
        run_ids = self.comm.all_gather(os.environ.get(runinfo.RUN_ID_ENV))
        if len(set(run_ids)) > 1:
            error = ConfigError(f"ranks disagree on the launcher run id ({runinfo.RUN_ID_ENV}): "
                                f"{dict(enumerate(run_ids))}; start every node with the same run")
            runinfo.report_failure(error, self.comm.rank)
            raise error

    # ---- save ------------------------------------------------------------------------
    @runinfo.reports_permanent
    def save(self, next_update: int, *, tokens_seen: int | None = None) -> SaveJob | None:
        """Snapshot the state as generation ``next_update`` (all ranks, same arguments).

        Returns the in-flight job, or None when skipped by the ``skip`` policy. Raises the
        ``CommitError`` of an earlier failed generation (once, on every rank) instead of saving.
        """
        self._check_open()
        if self._rehearsal is not None:  # dist-ckpt rehearse --script: one update, no write
            rehearsal.end_script_rehearsal(self.ctx, self._rehearsal, next_update)
        return self._marked_save(next_update, tokens_seen, may_stop=True)

    def _marked_save(self, next_update: int, tokens_seen: int | None, *, may_stop: bool) -> SaveJob | None:
        """``save`` after its checks; ``finish`` passes ``may_stop=False``: a run that ends
        under a preemption notice writes its DONE record instead of stopping one step short."""
        self.marks.mark(next_update)
        preempt = may_stop and self.preemption.due(next_update)
        if preempt and self.memory is not None:
            self.memory.force(generation_name(next_update))  # to the root, whatever persist_every says
        with self.marks.section("save", self._save_bound_s()):
            # the preemption's save is never skipped for a save in flight: it blocks instead
            job = self._save(next_update, tokens_seen, may_skip=not preempt)
        if preempt:
            self.wait()  # a failed save raises its CommitError here, not Preempted
            stop_preempted(self.ctx, self.replayer if self.memory is not None else None, next_update)
        return job

    def _save_bound_s(self) -> float:
        # the longest save() may block: the oldest save in flight, then this one, each bounded
        return 2 * self.config.commit_timeout_s + 60

    def _save(self, next_update: int, tokens_seen: int | None, *, may_skip: bool) -> SaveJob | None:
        started = time.perf_counter()
        self.stats.requested += 1
        live = self.state.tensor_state()
        fingerprint = layout_fingerprint(live)
        reuse = None if self.reuse is None else \
            self.reuse.plan(live, fingerprint, self.plans.written_fqns(fingerprint))
        keep_live = reuse.keeps_live if reuse is not None else None
        name = generation_name(next_update)
        ahead: Staged | None = None
        try:
            while True:
                self.inflight.reap()
                pending = facts.gather_start(self.ctx, self.inflight, self.plans, name, fingerprint,
                                             reuse.reused_bytes if reuse is not None else 0)
                if ahead is None and self.snapshots is None \
                        and len(self.inflight) < self.config.max_in_flight:
                    # the eager copy runs while the peers' facts arrive
                    ahead = stage_ahead(self.staging, live, pending, self.comm.rank, keep_live)
                agreed = facts.gathered(self.ctx, name, pending)
                self.inflight.raise_agreed(sorted({g for f in agreed for g in f.errors}))
                if not all(f.boundary for f in agreed):
                    self.state.check_boundary()
                    raise NotAtOptimizerBoundary("another rank is mid gradient accumulation")
                agreement.check_extras(agreed)
                if agreed[0].exists is not None:
                    raise GenerationExists(f"{name} {agreed[0].exists} under {self.config.root}")
                if not any(f.busy for f in agreed):
                    break
                if self.config.in_flight_policy == "skip" and may_skip:
                    self.stats.skipped += 1
                    log.warning("skipped save of %s: %d save(s) in flight", name, len(self.inflight))
                    return None
                # block: wait for the oldest save, then agree again (its failure raises here)
                self.inflight.wait_oldest()
            # once the in-flight bound allows the save: waiting or skipping comes first
            check_space(agreed, self.config.space_headroom_bytes, self.tiers.target.local_root)
            job = self._start(name, next_update, tokens_seen, live, fingerprint,
                              all(f.cached for f in agreed), agreed[0].attempt_id, started, ahead, reuse)
            ahead = None  # the job owns the slot now
        finally:
            if ahead is not None:  # the save did not start: the copy is dropped
                self.staging.release(ahead.slot)  # type: ignore[union-attr]
        self.stats.last_blocking_s = job.blocking_s
        return job

    def maybe_save(self, next_update: int, *, tokens_seen: int | None = None) -> SaveJob | None:
        """Save when the configured cadence says so (all ranks, once per update, same
        arguments): every ``save_every`` updates, or with ``cadence="auto"`` every
        ``T* = sqrt(2 C M)`` converted to updates from this run's measured save cost and step
        time. Returns the job when a save started, else None."""
        self._check_open()
        if self.schedule is None:
            raise ConfigError("maybe_save needs CheckpointConfig(save_every=N) (field save_every)")
        if not self.schedule.due(next_update) and self._rehearsal is None \
                and not self.preemption.due(next_update):
            self.marks.mark(next_update)
            return None
        job = self.save(next_update, tokens_seen=tokens_seen)
        if job is not None:
            self.schedule.saved(next_update, self.stats.last_blocking_s, self.comm.broadcast)
        return job

    def heartbeat(self, update: int, *, tokens_seen: int | None = None) -> None:
        """Tell the launcher this rank reached ``update`` (every rank, once per update, for
        jobs that save rarely; ``save`` and ``maybe_save`` do it themselves). Costs a few
        stores into a mapped file. Under a preemption notice, every rank saves the agreed
        update at this call (with ``tokens_seen``, as ``save`` would) and raises
        ``Preempted`` once it is durable on the root."""
        self._check_open()
        if self.preemption.due(update):
            self.save(update, tokens_seen=tokens_seen)
        else:
            self.marks.mark(update)

    @runinfo.reports_permanent
    def finish(self, final_update: int, *, tokens_seen: int | None = None) -> DoneRecord:
        """End the run (all ranks): commit generation ``final_update`` (unless a restart
        finds it committed already), wait for it and for the mirror, then write
        ``ROOT/DONE.json`` binding the contract digest, the generation's manifest digest and
        the tokens seen. Raises ``CommitError`` (per-rank map) when any step fails; no DONE
        is written then."""
        self._check_open()
        if self._rehearsal is not None:  # a rehearsal writes neither a generation nor DONE
            rehearsal.end_script_rehearsal(self.ctx, self._rehearsal, final_update)
        self.marks.mark(final_update)
        bound = self._save_bound_s() + self.config.close_timeout_s
        with self.marks.section("finish", bound):
            return self._finish(final_update, tokens_seen)

    def _finish(self, final_update: int, tokens_seen: int | None) -> DoneRecord:
        self.wait()
        name = generation_name(final_update)
        step = finish.final_step(self.ctx, name, self.memory)
        if self.replayer is not None:
            self.replayer.force(name)  # the mirror too, whatever mirror_every says
        if step is FinalStep.SAVE:
            self._marked_save(final_update, tokens_seen, may_stop=False)
        elif step is FinalStep.PERSIST_FROM_MEMORY:
            assert self.memory is not None
            finish.persist_from_memory(self.ctx, self.memory, name)
        self.wait()
        return finish.write_done(self.ctx, name, self.replayer)

    def _stage(self, live: dict, name: str, fingerprint: str, all_cached: bool, ahead: Staged | None,
               reuse: ReusePlan | None) -> tuple[StagingSlot | None, PreparedSave, PendingCopy | None]:
        """This rank's staged copy (or, without staging, the live tensors) and its save plan;
        returns (slot, prepared plan, lazy copy still to run)."""
        if ahead is not None:
            slot = ahead.slot
        else:
            faults.hit("stage.before", self.comm.rank)
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
                staged, pending = self.snapshots.begin(slot, live, generation=name, rank=self.comm.rank,
                                                       timeout_s=self.config.commit_timeout_s,
                                                       keep_live=reuse and reuse.keeps_live)
            else:
                staged = slot.stage(live, reuse and reuse.keeps_live)
            return slot, self.plans.prepare(staged, fingerprint, all_cached), pending
        except BaseException:
            if slot is not None:
                self.staging.release(slot)  # type: ignore[union-attr]
            raise

    def _start(self, name: str, next_update: int, tokens_seen: int | None, live: dict,
               fingerprint: str, all_cached: bool, attempt_id: str, started: float,
               ahead: Staged | None = None, reuse: ReusePlan | None = None) -> SaveJob:
        state = self.state
        state.next_update = next_update
        if tokens_seen is not None:
            state.tokens_seen = tokens_seen
        slot, prepared, pending = self._stage(live, name, fingerprint, all_cached, ahead, reuse)
        is_root = self.comm.rank == 0
        request = SaveRequest(
            generation=name, next_update=next_update, tokens_seen=state.tokens_seen,
            attempt=self.tiers.target.begin(name, attempt_id), prepared=prepared,
            signing_key=self.config.signing_key,
            digest_algorithm=self.config.digest_algorithm, reuse=reuse,
            rank_state=codec.dumps(state.rank_state()),
            global_state=codec.dumps(state.global_state()) if is_root else None,
            info=ManifestInfo(world_size=self.comm.world_size, components=list(state.components),
                             contract=state.contract,
                             contract_digest=contract_mod.digest(state.contract),
                             contract_values=state.contract_spec.values or None,
                             dist_ckpt_version=__version__) if is_root else None,
        )
        job = SaveJob(request, on_done=settling(self.reuse, reuse, fingerprint, next_update,
                                                functools.partial(self.after_commit.finished, slot)))
        job.blocking_s = time.perf_counter() - started  # set before the background thread starts
        args = (job, self.comm, self.config.io_threads, self.config.commit_timeout_s)
        if self.config.async_save:
            job.thread = threading.Thread(target=run_after_copy,
                                          args=(pending, *args, self.config.background_nice),
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

    # ---- draining --------------------------------------------------------------------
    def wait(self, timeout_s: float | None = None) -> None:
        """Drain every save in flight on this rank; raise failures not yet raised (once).
        Then wait for the retention passes those saves queued on this rank (``keep_last``,
        the memory tier's pruning): after ``wait()``, ``generations()`` shows what retention
        leaves. ``timeout_s`` bounds the saves only; a pass that deletes is not cut short."""
        self.inflight.wait(timeout_s)
        self.pruner.settle()

    def wait_staged(self) -> None:
        """With ``snapshot="lazy"``: return once the tensor copies of the saves in flight no
        longer read the live tensors. Call it before changing parameters or optimizer state in
        place other than by ``optimizer.step()`` (whose pre-hook waits by itself). Bounded by
        ``commit_timeout_s``: a copy not done by then fails its save instead. Returns at once
        otherwise."""
        if self.snapshots is not None:
            self.snapshots.wait()

    def close(self, *, after_error: bool = False) -> None:
        """Wait (bounded by ``close_timeout_s``) for outstanding saves, then release resources.
        ``after_error`` (``with`` passes it when the block raised): the job is failing, so the
        memory tier's ring neither sends a last replica nor waits for its peers' (a lost peer
        would hold the exit, and so the restart, for the handshake's whole bound).

        Leaves nothing behind for interpreter finalisation, where a thread that needs the GIL
        is killed wherever it stands (inside native code: std::terminate, SIGABRT): every
        thread this manager started is joined (save threads within ``close_timeout_s``),
        staging buffers and the cached plan are dropped, and the checkpoint gloo group is
        destroyed and freed, which joins its worker threads. Local to this rank: no collective.
        """
        _OPEN.discard(self)
        if self._closed:
            return
        deadline = time.monotonic() + self.config.close_timeout_s
        try:
            self.wait(self.config.close_timeout_s)
            if self.replayer is not None and self.comm.rank == 0 and not self.replayer.drain(
                    self.config.close_timeout_s):
                log.error("mirror uploads still pending at close; they are not durable remotely")
        finally:
            self._closed = True
            if self.replayer is not None:
                self.replayer.close(self.config.close_timeout_s)
            self.pruner.close()
            self.preemption.close()
            self.marks.close()
            running = self.inflight.join(deadline)
            if running:
                log.error("save(s) %s still running at close; they fail if the process exits first",
                          ", ".join(running))
            if self.memory is not None:
                self.memory.close(after_error)
            if self.snapshots is not None:
                self.snapshots.close()  # the optimizer step pre-hooks
            if self.staging is not None and not self.inflight.jobs:
                self.staging.free()
            self.plans.clear()
            self.comm.close()
            if self._scratch is not None and not self.inflight.jobs:
                with contextlib.suppress(OSError):  # absent, or still holding a save's files
                    os.rmdir(self._scratch)

    def _check_open(self) -> None:
        if self._closed:
            raise CommitError("CheckpointManager is closed")

    # ---- restore and listing ---------------------------------------------------------
    @runinfo.reports_permanent
    def restore(self, *, components: Iterable[str] | None = None,
                allow_contract_change: bool | None = None,
                verify_digests: bool = True,
                on_all_rejected: Literal["raise", "fresh"] | None = None) -> RestoreResult:
        """Load the newest generation that validates (all ranks); a fresh start when the roots
        hold none. When they hold committed generations and every one is rejected, raise
        ``NoValidGeneration`` unless ``on_all_rejected`` (default: the config's) is ``"fresh"``."""
        self._check_open()
        self.wait_staged()  # loading writes into the live tensors
        target = rehearsal.script_mode()
        if target is not None:
            self._rehearsal = rehearsal.rehearse(self.ctx, None if target == "newest" else target, None,
                                                 script=True)
            return RestoreResult(next_update=self._rehearsal.next_update,
                                 generation=self._rehearsal.generation)
        with self.marks.section("restore", self.comm.timeout_s):
            if self.memory is not None:
                self.memory.before_restore()
            result = resume(self.ctx, components, allow_contract_change, verify_digests, on_all_rejected)
            if self.memory is not None:
                self.memory.after_restore(self.comm, result)
            seed_after_restore(self.reuse, self.state, result, self.tiers.target)
        if self.schedule is not None and result.generation is not None:
            self.schedule.last_saved = result.next_update
        return result

    def rehearse(self, step_fn: Callable[[TrainState], float] | None = None, *,
                 generation: str | None = None) -> RehearsalResult:
        """Prove a generation restorable (all ranks), on a manager built around fresh objects:
        load it (the newest that validates, or ``generation``) with every component checked,
        run ``step_fn(state) -> loss`` once, and record the outcome (loss, digest of the
        updated state) in ``ROOT/rehearsals.json``. Raises ``RehearsalFailed`` naming the
        component (contract, model, optimizer, rng, load, update) that failed; without
        ``step_fn`` no update runs and the rehearsal fails in ``update`` after loading."""
        self._check_open()
        return rehearsal.rehearse(self.ctx, generation, step_fn)

    def rewrite_frozen(self) -> None:
        """The next save writes every frozen tensor in full (this rank; call it on every rank
        that changed one): after a write the version counter cannot see, such as an
        in-place op through ``param.data``. A no-op with ``incremental=False``."""
        if self.reuse is not None:
            self.reuse.rewrite_frozen()

    def pin(self, generation: str, label: str | None = "pinned") -> dict[str, str]:
        """Pin a committed generation so that no pruning deletes it (``label=None`` unpins).

        All ranks call it together; rank 0 updates ``ROOT/pins.json`` and every rank returns
        the new pins or raises the same error.
        """
        self._check_open()
        mirror = self.tiers.mirror.store if self.tiers.mirror is not None else None
        return retention.pin_on_all_ranks(self.comm, self.tiers.root.store, mirror, generation, label)

    def generations(self) -> list[GenerationInfo]:
        """Every generation under the root, newest first, with its state (no digest check;
        with a signing key, a generation whose manifest signature fails is invalid)."""
        return inventory(self.tiers.root.store, digests=False, key=self.config.signing_key)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(after_error=exc_type is not None)
