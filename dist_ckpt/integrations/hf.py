"""``DistCkptTrainer``: ``transformers.Trainer`` with dist_ckpt's checkpoints and resume.

    trainer = DistCkptTrainer(model=model, args=training_args, train_dataset=dataset,
                              checkpoint_config=CheckpointConfig(async_save=True))
    trainer.train()       # resumes from the newest valid generation of the root, if any

The arguments are the Trainer's, plus ``checkpoint_config`` (default ``CheckpointConfig()``:
the root from ``DIST_CKPT_ROOT``, which ``python -m launch`` exports), ``contract`` (added
to the model's config, which is the default contract) and ``numpy_generators`` (every NumPy
``Generator`` the job draws from, as for ``TrainState``). A generation holds the model, the
optimizer, the LR scheduler, the scaler if any, every rank's RNG streams, the data position
(a :class:`~dist_ckpt.integrations.data.ResumableLoader`: reshard-safe, nothing replayed or
skipped) and the ``TrainerState`` fields a continuation needs (global step, epoch, log
history, best metric, FLOs, tokens, stateful callbacks). The Trainer's checkpoint folders are
not written; ``save_model()`` still exports the model.

When it saves: at the Trainer's own decisions (``save_strategy`` steps, epoch or best, and a
callback's ``control.should_save``), or, when ``checkpoint_config.save_every`` is set, at that
cadence alone (``maybe_save``, ``cadence="auto"`` included). Every other update tells the
launcher it progressed (``heartbeat``). Under a preemption notice the agreed update is saved
and ``Preempted`` propagates out of ``train()`` (exit 75). At the end ``train()`` calls
``finish()`` (the final generation, then DONE).

Where it hooks into the Trainer (private methods: ``hf_state.OVERRIDE_POINTS`` are checked at
construction; ``SUPPORTED`` is the tested range, ``get_resumed_dataloader`` first appears in
transformers 5.25, and accelerate's FSDP2 plugin with the Trainer's arguments needs 1.6):

- ``get_train_dataloader``: the ``ResumableLoader``, not prepared by accelerate, whose
  ``BatchSamplerShard`` would shard the sampler's per-rank batches a second time; inputs reach
  the device through ``_prepare_inputs`` as before;
- ``_init_training_state``: prepares model, optimizer and scheduler the way the loop's
  ``_prepare_for_training`` would, opens the manager, restores, and returns the epoch and the
  batches of it consumed (at this world size) to the loop; ``_prepare_for_training`` then
  returns what was prepared;
- ``_run_epoch``: the resumed epoch starts at the restored batch (``get_resumed_dataloader``
  returns the loader as it is); ``_load_rng_state`` puts the restored RNG streams back just
  before its first step, as the Trainer's own resume does;
- ``_save_checkpoint`` and ``_maybe_log_save_evaluate``: one manager call per update;
- ``set_initial_training_values``: with ``max_steps``, epochs run until ``max_steps``, so a
  resume at another world size (more steps per epoch) still reaches it.

Call order (every rank, main thread): construct after ``init_process_group`` (the
``TrainingArguments`` initialise it); ``train()`` on every rank. Inside it, the manager is
opened and restored once, called once per optimizer update, finished, and closed (also when
``train()`` raises).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import has_length, seed_worker
from transformers.utils import is_datasets_available

from ..config import CheckpointConfig
from ..errors import ConfigError
from ..export.source import HF_CONFIG_FIELD
from ..lifecycle.done import DoneRecord
from ..manager import CheckpointManager
from ..restart import rng
from ..restart.state import TrainState
from .data import ResumableLoader, seeded_generator
from .hf_state import (
    SAMPLING_STRATEGIES,
    TRAINER_STATE_KEY,
    CarriedLog,
    missing_override_points,
    refused_settings,
    restore_trainer_state,
    resume_position,
    trainer_extras,
)

log = logging.getLogger(__name__)
SUPPORTED = "transformers>=5.25,<5.26 with accelerate>=1.6,<1.17"
# keys of a model config that name where or with what it was written, not what it is: a
# resume under another transformers release keeps its contract
_CONFIG_PROVENANCE = ("transformers_version", "_name_or_path", "_commit_hash")


class DistCkptTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints and resume are dist_ckpt's.

    ``checkpoint_manager`` is the manager of the current (or last) ``train()`` call;
    ``checkpoint_done`` the DONE record its ``finish()`` wrote. ``save_total_limit`` becomes
    ``keep_last`` when the config sets none. ``train(resume_from_checkpoint=...)`` accepts
    ``None``, ``True`` or ``False``: every call resumes from the newest valid generation of
    the root (the launcher's restarts need it); a path is refused.
    """

    def __init__(self, *args: Any, checkpoint_config: CheckpointConfig | None = None,
                 contract: Mapping[str, Any] | None = None,
                 numpy_generators: Mapping[str, np.random.Generator] | None = None, **kwargs: Any) -> None:
        missing = missing_override_points(Trainer)
        if missing:
            raise ConfigError("this transformers.Trainer lacks what DistCkptTrainer overrides "
                              f"(supported: {SUPPORTED}): {'; '.join(missing)}")
        super().__init__(*args, **kwargs)
        parallel = self.get_tp_size() * self.get_cp_size() * self.get_sp_size()
        refused = refused_settings(self.args, deepspeed=self.is_deepspeed_enabled, model_parallel=parallel)
        if refused:
            raise ConfigError("DistCkptTrainer cannot honour " + "; ".join(refused))
        config = checkpoint_config if checkpoint_config is not None else CheckpointConfig()
        self.checkpoint_config = _with_retention(config, self.args.save_total_limit)
        self.checkpoint_contract = dict(contract or {})
        self.numpy_generators = dict(numpy_generators or {})
        self.checkpoint_manager: CheckpointManager | None = None
        self.checkpoint_done: DoneRecord | None = None
        self._train_loader: ResumableLoader | None = None
        self._train_state: TrainState | None = None
        self._prepared: tuple[Any, Any] | None = None
        self._resumed_from: str | None = None
        self._restored_rng: dict[str, Any] | None = None
        self._carried_log = CarriedLog()
        self._marked = self._saved = -1  # the last update the manager heard of / saved

    # ---- data ------------------------------------------------------------------------
    def get_train_dataloader(self) -> ResumableLoader:  # type: ignore[override]
        """This rank's share of every global batch, from a seeded permutation whose position
        is restored with the generation (the Trainer's collator and column removal kept)."""
        dataset, args = self.train_dataset, self.args
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, IterableDataset) or not has_length(dataset):
            raise ConfigError("DistCkptTrainer needs an indexable train_dataset with a length: the "
                              "resumable sampler addresses samples by index")
        collator = self.data_collator
        if _is_datasets_dataset(dataset):  # as the Trainer's own loader: columns, or the collator
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        seed = args.data_seed if args.data_seed is not None else args.seed
        workers: dict[str, Any] = {}
        if args.dataloader_num_workers > 0:
            workers = {"prefetch_factor": args.dataloader_prefetch_factor,
                       "persistent_workers": args.dataloader_persistent_workers,
                       "multiprocessing_context": args.dataloader_multiprocessing_context,
                       "worker_init_fn": partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                 rank=args.process_index)}
        strategy = str(getattr(args, "train_sampling_strategy", "random"))
        self._train_loader = ResumableLoader(
            dataset, self._train_batch_size, seed=seed, shuffle=SAMPLING_STRATEGIES[strategy],
            rank=args.process_index, world_size=args.world_size, collate_fn=collator,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            # the loader draws its workers' base seed from this generator at each iter(), not
            # from the global stream: a resumed epoch's iter() would shift the dropout masks
            generator=seeded_generator(seed), **workers)
        return self._train_loader

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        if dataloader is self._train_loader:
            return dataloader  # it continues from the restored position by itself
        return super().get_resumed_dataloader(dataloader, num_batches)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """The RNG streams as ``restore()`` left them, once more: the loop calls this just
        before the resumed epoch's first step, after whatever drew in between (an
        ``eval_on_start`` evaluation, a callback's ``on_train_begin``)."""
        if self._restored_rng is not None:
            rng.restore(self._restored_rng, self.numpy_generators)
            self._restored_rng = None

    # ---- the loop's set-up -----------------------------------------------------------
    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        values = list(super().set_initial_training_values(args, dataloader))
        if args.max_steps > 0:
            # the loop stops at max_steps; a resume at another world size has more or fewer
            # steps per epoch than the epoch count computed here assumes
            values[0] = sys.maxsize
        return tuple(values)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> tuple[int, int]:
        super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        if self._train_loader is None:
            raise ConfigError("DistCkptTrainer's loop needs its get_train_dataloader()")
        # restoring needs the prepared optimizer and scheduler, and the loop reads where to
        # start before it prepares them: prepare now, hand the result over below
        self._prepared = super()._prepare_for_training(max_steps, self._train_loader, None)
        return self._open_and_restore()

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: str | None) -> tuple[Any, Any]:
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        return prepared

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if self.args.max_steps > 0 and self.state.global_step >= self.args.max_steps:
            # resumed at the end (the loop would take one more step before its check)
            self.control.should_training_stop = True
            return None
        if self._resumed_from is not None and kwargs.get("epoch") == kwargs.get("epochs_trained"):
            # the loop's resume branch: it sets its step counters from the consumed batches
            kwargs["resume_from_checkpoint"] = self._resumed_from
        return super()._run_epoch(*args, **kwargs)

    def _open_and_restore(self) -> tuple[int, int]:
        """Open the manager on the prepared objects and restore (all ranks); returns
        (epochs trained, batches of the current epoch trained)."""
        assert self._train_loader is not None
        scaler = getattr(self.accelerator, "scaler", None)
        self._train_state = TrainState(
            self.model, getattr(self.optimizer, "optimizer", self.optimizer), scheduler=self.lr_scheduler,
            scaler=scaler, sampler=self._train_loader, numpy_generators=self.numpy_generators,
            contract=self._contract(), extras={})
        self._marked = self._saved = -1
        self._resumed_from = self._restored_rng = None
        self._carried_log = CarriedLog()
        self.checkpoint_done = None
        self.checkpoint_manager = CheckpointManager(self.checkpoint_config, self._train_state)
        resumed = self.checkpoint_manager.restore()
        if resumed.generation is None:
            return 0, 0
        self._carried_log = restore_trainer_state(
            self.state, self._train_state.extras.get(TRAINER_STATE_KEY), resumed.next_update)
        self._load_callback_state()
        self._marked = self._saved = resumed.next_update
        self._resumed_from = resumed.generation
        self._restored_rng = rng.capture(self.numpy_generators)
        epoch, consumed = resume_position(self._train_loader)
        if self.args.process_index == 0:
            log.info("resumed from %s: global step %d, epoch %d after %d of its %d batches",
                     resumed.generation, resumed.next_update, epoch, consumed, len(self._train_loader))
        # steps of this world size the restored position stands for; another world size saved
        # a different number of steps for the same samples
        offset = resumed.next_update - (epoch * len(self._train_loader) + consumed)
        if offset and self.args.max_steps <= 0:
            self._retime_schedule(offset)
        return epoch, consumed

    def _retime_schedule(self, offset: int) -> None:
        """A resume at another world size, run by epochs: the epochs left take this world
        size's steps counted on from the restored global step, so the Trainer's stop at
        ``max_steps`` and the LR schedule it created (restored state, new horizon) end with
        the data instead of too early or too late."""
        self.state.max_steps += offset
        if not self._created_lr_scheduler:  # the caller's own scheduler: its horizon is theirs
            log.warning("resumed at another world size: the LR scheduler passed in keeps its horizon")
            return
        assert self._train_state is not None
        restored = self.lr_scheduler.state_dict()
        self.lr_scheduler = None
        self.create_scheduler(num_training_steps=self.state.max_steps, optimizer=self.optimizer)
        self.lr_scheduler.load_state_dict(restored)
        self._train_state.scheduler = self.callback_handler.lr_scheduler = self.lr_scheduler

    def _contract(self) -> dict[str, Any]:
        """The model's config (what its numbers mean; under the field ``dist-ckpt export``
        writes ``config.json`` from) and the caller's ``contract``."""
        contract: dict[str, Any] = {}
        config = getattr(getattr(self.model, "config", None), "to_json_string", None)
        if callable(config):
            values = json.loads(config(use_diff=False))
            contract[HF_CONFIG_FIELD] = {k: v for k, v in values.items() if k not in _CONFIG_PROVENANCE}
        contract.update(self.checkpoint_contract)
        return contract

    # ---- the loop's saves ------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's cadence asks for a checkpoint: a generation (all ranks)."""
        self._checkpoint(save=True)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        self._checkpoint(save=False)

    def _checkpoint(self, *, save: bool) -> None:
        """One manager call per update: ``save`` when the Trainer's cadence asks (unless the
        config has a cadence of its own), else ``maybe_save`` (config cadence) or
        ``heartbeat``. The Trainer calls ``_maybe_log_save_evaluate`` again at an epoch's end
        with the same global step; that call finds the update handled."""
        manager = self.checkpoint_manager
        if manager is None or self._train_state is None:
            return
        update = self.state.global_step
        if save and (manager.schedule is not None or update == self._saved):
            return
        if not save and update == self._marked:
            return
        if save:
            self.store_flos()  # collective, as in the Trainer's own save
        self._refresh_extras()
        tokens = self.state.num_input_tokens_seen or None
        self._marked = update
        if save:
            manager.save(update, tokens_seen=tokens)
            self._saved = update
        elif manager.schedule is not None:
            if manager.maybe_save(update, tokens_seen=tokens) is not None:
                self._saved = update
        else:
            manager.heartbeat(update, tokens_seen=tokens)

    def _refresh_extras(self) -> None:
        """The carried ``TrainerState`` fields into the state's extras, before each manager
        call (any of them may save)."""
        assert self._train_state is not None
        callbacks = (*self.callback_handler.callbacks, self.control)
        stateful = [callback for callback in callbacks if isinstance(callback, ExportableState)]
        self._train_state.extras[TRAINER_STATE_KEY] = trainer_extras(self.state, stateful, self._carried_log)

    # ---- train -----------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """The Trainer's ``train``, resumed from the newest valid generation and ended with
        ``finish()``; the manager is closed on the way out, also when it raises (``Preempted``
        included: let it propagate, the process exits 75)."""
        if isinstance(resume_from_checkpoint, str):
            raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint!r}: DistCkptTrainer resumes "
                              "from the newest valid generation under checkpoint_config.root; pass "
                              "True, False or None")
        failed = True
        try:
            output = super().train(resume_from_checkpoint=None, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            assert self.checkpoint_manager is not None
            # extras as of the last update: the run's summary log (timings) differs by rank
            self.checkpoint_done = self.checkpoint_manager.finish(
                self.state.global_step, tokens_seen=self.state.num_input_tokens_seen or None)
            failed = False
            return output
        finally:
            self._prepared = None
            if self.checkpoint_manager is not None:
                self.checkpoint_manager.close(after_error=failed)
            self._train_state = None


def _is_datasets_dataset(dataset: Any) -> bool:
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def _with_retention(config: CheckpointConfig, save_total_limit: int | None) -> CheckpointConfig:
    """``save_total_limit`` as ``keep_last`` when the config keeps every generation."""
    if config.keep_last is not None or not save_total_limit:
        return config
    try:
        return CheckpointConfig.model_validate({**config.model_dump(), "keep_last": save_total_limit})
    except ConfigError as exc:
        raise ConfigError(f"save_total_limit={save_total_limit} becomes keep_last: {exc}") from None
