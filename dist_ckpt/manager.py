"""``CheckpointManager``: the public face (save / wait / close / restore / generations).

Call order: construct on every rank after ``init_process_group`` (collective: it creates the
checkpoint gloo group); ``restore()`` on every rank before training; ``save(next_update)`` on
every rank at the same optimizer boundaries; ``wait()`` / ``close()`` on every rank at the end.
``save()`` runs one small all-gather on the checkpoint group so that all ranks agree on
errors to raise, skipping, and plan reuse; everything after the staging copy runs in the
background for an asynchronous save and coordinates only through the c10d store.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Literal

from . import logs, marks, runinfo
from .config import CheckpointConfig
from .context import Context
from .errors import CommitError, ConfigError
from .format.inventory import GenerationInfo, inventory
from .format.manifest import generation_name
from .lifecycle import exit_guard, finish, retention, startup
from .lifecycle.after_commit import AfterCommit
from .lifecycle.done import DoneRecord
from .lifecycle.preemption import PreemptionWatch, stop_preempted
from .lifecycle.pruning import Pruner
from .lifecycle.replication import open_replayer
from .protocol.comm import Comm
from .restart import contract as contract_mod
from .restart.state import TrainState
from .restore import rehearse as rehearsal
from .restore.loader import RestoreResult
from .restore.rehearse import RehearsalResult
from .save.coordinator import SaveJob
from .save.front import SaveFront
from .save.inflight import InFlight, SaveStats
from .save.planning import SavePlanCache
from .save.reuse import open_ledger
from .save.schedule import SaveSchedule
from .save.snapshot import lazy_snapshots
from .save.staging import StagingPool
from .tiers.placement import place_tiers

log = logs.get(__name__)


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
        startup.check_run_id(self.comm)
        self.marks = marks.open_writer(runinfo.launch_dir(), self.comm.rank)
        self.preemption = PreemptionWatch(self.comm, runinfo.preempt_notice_path(),
                                          timeout_s=config.commit_timeout_s)
        opened = startup.open_tiers(config, self.comm)
        self.tiers, self.memory, self._scratch = opened.tiers, opened.memory, opened.scratch
        self.ctx = Context(self.comm, config, state, self.tiers,
                           place_tiers(self.comm, config, opened.tiers.root, self.tiers.target))
        startup.share_pins(self.ctx)
        self.pruner = Pruner(self.ctx, self.memory)
        self.replayer = open_replayer(self.ctx, self.memory, self.pruner)
        self.staging = StagingPool(config.max_in_flight) if config.async_save else None
        self.after_commit = AfterCommit(self.ctx, self.staging, self.memory, self.replayer, self.pruner)
        self.plans = SavePlanCache(self.comm)
        self.reuse = open_ledger(config, state, single_copy=len(self.comm.fs_group) == self.comm.world_size,
                                 shares_objects=self.tiers.target.shares_objects)
        self.inflight = InFlight(self.comm)
        self.front = SaveFront(self.ctx, inflight=self.inflight, plans=self.plans,
                               staging=self.staging, snapshots=self.snapshots, reuse=self.reuse,
                               finished=self.after_commit.finished)
        self._closed = False
        self._rehearsal: RehearsalResult | None = None
        self.schedule = None if config.save_every is None else SaveSchedule(
            every=config.save_every, auto=config.cadence == "auto", mtbf_s=config.mtbf_s)
        exit_guard.hold(self)
        runinfo.report(self.comm.rank, root=config.root, mirror=config.mirror,
                       world_size=self.comm.world_size, pid=os.getpid(), memory_tier=config.memory_tier,
                       contract_digest=contract_mod.digest(state.contract))

    @property
    def stats(self) -> SaveStats:
        return self.inflight.stats

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
        with self.marks.section("save", self.front.bound_s()):
            # the preemption's save is never skipped for a save in flight: it blocks instead
            job = self.front.save(next_update, tokens_seen, may_skip=not preempt)
        if preempt:
            self.wait()  # a failed save raises its CommitError here, not Preempted
            stop_preempted(self.ctx, self.replayer if self.memory is not None else None, next_update)
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
        bound = self.front.bound_s() + self.config.close_timeout_s
        with self.marks.section("finish", bound):
            return finish.end_run(self.ctx, generation_name(final_update), self.memory, self.replayer,
                                  lambda: self._marked_save(final_update, tokens_seen, may_stop=False),
                                  self.wait)

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
        exit_guard.release(self)
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
            self.comm.close(0.0 if after_error else self.config.close_timeout_s)
            if not self.inflight.jobs:
                startup.remove_scratch(self._scratch)

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
            generation = None if target == "newest" else target
            self._rehearsal = rehearsal.rehearse(self.ctx, generation, None, script=True)
            return RestoreResult(next_update=self._rehearsal.next_update,
                                 generation=self._rehearsal.generation)
        with self.marks.section("restore", self.comm.timeout_s):
            result = startup.restore(self.ctx, self.memory, self.reuse, components, allow_contract_change,
                                     verify_digests, on_all_rejected)
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
