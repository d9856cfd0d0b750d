"""``DistCkptStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2) for the ``Trainer``, whose
checkpoints are dist_ckpt generations (docs/integrations.md).

What goes where in a generation: the model and the optimizer as DCP shards (the
``TrainState``'s own), the ``lr_scheduler_configs``' schedulers as its scheduler, the RNG of
every rank, and everything else of Lightning's checkpoint dict (loops with the dataloader's
state, callbacks, epoch and global step, precision plugin, datamodule, hyper-parameters) as
JSON ``extras``, rank 0's as Lightning keeps them. The update number is ``trainer.global_step``.

Call order (the Trainer's, every rank): ``setup`` builds the model and optimizers, then, when
fitting with ``resume="auto"``, restores the newest generation under the root and hands
Lightning the checkpoint dict it would have read from a file; ``load_checkpoint`` (a
``ckpt_path``) returns that dict or restores; the fit loop restores the loops and the
dataloader's position from it; ``on_train_batch_start`` of the first batch puts every RNG back
to the saved state, undoing what the hooks and the dataloader's ``iter()`` drew since the
restore; ``save_checkpoint`` (``ModelCheckpoint``, ``trainer.save_checkpoint``) saves;
``teardown`` after a fit that ended normally saves the final update and calls ``finish``
(``ROOT/DONE.json``), then closes the manager.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from .. import logs
from ..config import CheckpointConfig
from ..errors import ConfigError, NotAtOptimizerBoundary
from ..restart import codec, rng
from ..restart.state import Stateful
from .lightning_common import StrategyCheckpoints

log = logs.get(__name__)

# the entries of Lightning's checkpoint dict that the TrainState holds itself
TENSOR_ENTRIES = ("state_dict", "optimizer_states", "lr_schedulers")


class DistCkptStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose ``save_checkpoint``, ``load_checkpoint`` and
    ``remove_checkpoint`` go through a ``CheckpointManager`` under ``checkpoint_config.root``.

    ``resume="auto"`` (default): ``trainer.fit(model)`` resumes from the newest generation that
    validates, or starts fresh when the root holds none, like ``CheckpointManager.restore()``;
    the same script under ``python -m launch`` resumes after each restart. ``"explicit"``: only
    a ``ckpt_path`` restores. ``finish_on_fit_end``: a fit that ends without an exception saves
    its final update and writes ``ROOT/DONE.json`` (what the launcher waits for).
    ``contract`` and ``numpy_generators`` are ``TrainState``'s. The other arguments are
    ``ModelParallelStrategy``'s.
    """

    def __init__(self, checkpoint_config: CheckpointConfig | None = None, *,
                 resume: Literal["auto", "explicit"] = "auto", finish_on_fit_end: bool = True,
                 contract: Mapping[str, Any] | None = None,
                 numpy_generators: Mapping[str, np.random.Generator] | None = None, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise ConfigError("save_distributed_checkpoint=False: dist_ckpt always saves DCP shards "
                              "(a consolidated copy is `dist-ckpt export`)")
        if resume not in ("auto", "explicit"):
            raise ConfigError(f"resume={resume!r}: expected 'auto' or 'explicit'")
        super().__init__(**kwargs)
        self.checkpoint_config = checkpoint_config if checkpoint_config is not None else CheckpointConfig()
        # Lightning's automatic optimization leaves the last step's gradients on the
        # parameters until the next zero_grad: the boundary is the fit loop's to say
        self.checkpoints = StrategyCheckpoints(self.checkpoint_config, contract=contract,
                                               numpy_generators=numpy_generators,
                                               require_optimizer_boundary=False)
        self.resume = resume
        self.finish_on_fit_end = finish_on_fit_end
        self._resumed: tuple[str, dict[str, Any]] | None = None  # (generation, Lightning's dict)
        self._rewind: dict[str, Any] | None = None  # the restored RNG, put back before the first batch
        self._left_out: set[str] = set()  # hyper-parameter entries warned about (once each)

    # ---- the trainer's objects -------------------------------------------------------
    def _trainer(self) -> pl.Trainer:
        module = self.lightning_module
        if module is None or module._trainer is None:
            raise ConfigError("DistCkptStrategy has no trainer attached (save and load run inside a Trainer)")
        return module.trainer

    def _open(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        if trainer.state.fn != TrainerFn.FITTING:
            self.checkpoints.open(self.model, None, {}, None)
            return
        optimizers = [opt._optimizer if hasattr(opt, "_optimizer") else opt for opt in self.optimizers]
        if len(optimizers) > 1:
            raise ConfigError(f"{len(optimizers)} optimizers: a dist_ckpt TrainState holds one")
        schedulers: dict[str, Stateful] = {
            str(index): config.scheduler for index, config in enumerate(trainer.lr_scheduler_configs)}
        self.checkpoints.open(self.model, optimizers[0] if optimizers else None, schedulers, None)

    # ---- Lightning's state dicts: the TrainState reads the live tensors itself --------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the generation's model shards come from the TrainState, not this dict."""
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Empty: the generation's optimizer shards come from the TrainState, not this dict."""
        return {}

    # ---- restore ----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._resumed, self._rewind = None, None
        if trainer.state.fn != TrainerFn.FITTING or self.resume != "auto":
            return
        loaded = self._restore(trainer, None)
        if loaded is None:
            return
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not hasattr(connector, "_loaded_checkpoint"):
            raise ConfigError(f"lightning {pl.__version__}: no Trainer._checkpoint_connector."
                              "_loaded_checkpoint to hand the restored state to; use resume='explicit' "
                              "and ckpt_path=ROOT")
        # what Lightning's resume_start would have read from a file: resume_start(None) keeps it,
        # and the connector's restore_* steps read it
        connector._loaded_checkpoint = loaded

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        """``ckpt_path``: the root (the newest generation that validates) or a generation under
        it (``gen-N``, ``ROOT/gen-N``: the newest committed). Lightning resolves ``"last"`` and
        ``"best"`` itself from ModelCheckpoint's files, which this strategy never writes."""
        wanted = self.checkpoints.wanted(checkpoint_path)
        if self._resumed is not None:
            generation, loaded = self._resumed
            if wanted not in (None, generation):
                raise ConfigError(f"ckpt_path={os.fspath(checkpoint_path)!r}: this fit resumed from "
                                  f"{generation} already (resume='auto'), the newest that validates")
            return loaded
        loaded = self._restore(self._trainer(), wanted)
        if loaded is None:
            raise ConfigError(f"ckpt_path={os.fspath(checkpoint_path)!r}: no committed generation under "
                              f"{self.checkpoints.root} to load")
        return loaded

    def _restore(self, trainer: pl.Trainer, wanted: str | None) -> dict[str, Any] | None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._open(trainer)
        result = self.checkpoints.restore(wanted, None if fitting else ("model", "extras"))
        if result.generation is None:
            return None
        loaded = self.checkpoints.restored_extras()
        if fitting:
            # restored through the TrainState; Lightning loads them again from this list
            loaded["lr_schedulers"] = [config.scheduler.state_dict()
                                       for config in trainer.lr_scheduler_configs]
            self._rewind = rng.capture(self.checkpoints.numpy_generators)
            self._resumed = (result.generation, loaded)
        return loaded

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first batch after a restore: every RNG stream back to the saved state, right
        before its ``training_step``. What drew since the restore is undone: hooks, and the
        dataloader's ``iter()`` (a ``DataLoader`` draws its base seed from the global torch
        stream, here at the batch's fetch), which the uninterrupted run drew at the epoch's start."""
        super().on_train_batch_start(batch, batch_idx)
        if self._rewind is not None:
            rng.restore(self._rewind, self.checkpoints.numpy_generators)
            self._rewind = None

    # ---- save -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Generation ``trainer.global_step`` under the root; ``filepath`` is a label."""
        if storage_options is not None:
            raise ConfigError("storage_options: set CheckpointConfig(storage_options=...) instead")
        if "optimizer_states" not in checkpoint:
            raise ConfigError("a weights-only checkpoint is no restart state: dist_ckpt saves the whole "
                              "state (`dist-ckpt export` writes the weights alone)")
        trainer = self._trainer()
        self.checkpoints.check_label(filepath, trainer.global_step)
        if trainer.training and trainer.fit_loop._should_accumulate():
            raise NotAtOptimizerBoundary(f"save at batch {trainer.fit_loop.batch_idx}: mid gradient "
                                         "accumulation (accumulate_grad_batches); save at an optimizer step")
        self._open(trainer)
        # Lightning keeps rank 0's metadata; so do we, and every rank saves the same extras
        extras = self.broadcast({key: value for key, value in checkpoint.items()
                                 if key not in TENSOR_ENTRIES})
        self.checkpoints.save(trainer.global_step, self._without_unsaved_hparams(extras))

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Nothing is removed: a path is a label, and retention is dist_ckpt's (keep_last,
        keep_every, pins)."""
        log.debug("remove_checkpoint(%s): retention is dist_ckpt's; nothing removed", os.fspath(filepath))

    # ---- the end ----------------------------------------------------------------------
    def teardown(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        failed = trainer is None or trainer.interrupted
        try:
            if not failed and trainer is not None and self.finish_on_fit_end \
                    and trainer.state.fn == TrainerFn.FITTING:
                trainer.save_checkpoint(self.checkpoints.root)  # skipped when this update is saved
                self.checkpoints.finish(trainer.global_step)
        finally:
            self.checkpoints.close(after_error=failed)
            self._resumed, self._rewind = None, None
            super().teardown()

    def _without_unsaved_hparams(self, extras: dict[str, Any]) -> dict[str, Any]:
        """Hyper-parameters without a JSON form are left out, with a warning the first time: a
        resume never reads them (``load_from_checkpoint`` does, which is not this checkpoint's use)."""
        kept = dict(extras)
        module = pl.LightningModule
        for key in (module.CHECKPOINT_HYPER_PARAMS_KEY, module.CHECKPOINT_HYPER_PARAMS_NAME,
                    module.CHECKPOINT_HYPER_PARAMS_TYPE):
            if key not in kept:
                continue
            try:
                codec.encode(kept[key])
            except TypeError as exc:
                if key not in self._left_out:
                    log.warning("checkpoint entry %r left out of every save: %s (dist_ckpt stores JSON, "
                                "no pickle)", key, exc)
                    self._left_out.add(key)
                del kept[key]
        return kept
