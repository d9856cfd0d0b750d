"""What the two Lightning strategies share: one ``CheckpointManager`` at a time over the
strategy's objects, and how a Lightning path names a generation (docs/integrations.md).

A Lightning path is mapped to dist_ckpt like this, for saves and loads alike:

- every generation lives under ``checkpoint_config.root`` and is named by its update number
  (``gen-<update>``); a save's path is only a label (``ModelCheckpoint`` passes
  ``dirpath/epoch=0-step=6.ckpt``), nothing is written there. A label that is itself a
  generation name must name the update being saved;
- a load's path is the root or ``"last"`` (the newest generation that validates), or a
  generation (``gen-N``, ``ROOT/gen-N``), which must be the newest one committed: dist_ckpt
  restores the newest generation that validates, never an older one by choice;
- removing a path removes nothing: retention is dist_ckpt's (``keep_last``, ``keep_every``,
  pins).

Call order (every rank, the main thread, at the same points: a strategy's save, load, finish and
teardown are collective): :meth:`StrategyCheckpoints.open` before :meth:`save`,
:meth:`restore` or :meth:`finish`; :meth:`close` at the end (``finish`` closes too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .. import logs
from ..config import CheckpointConfig
from ..errors import ConfigError, ValidationError
from ..format.manifest import parse_generation
from ..manager import CheckpointManager
from ..restart import codec
from ..restart.state import Stateful, TrainState
from ..restore.loader import RestoreResult

log = logs.get(__name__)

NEWEST = "last"  # the load path that means the newest generation that validates


class NamedSchedulers:
    """Several schedulers as the one ``TrainState.scheduler``: a JSON object keyed by name."""

    def __init__(self, schedulers: Mapping[str, Stateful]) -> None:
        self.schedulers = dict(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return {name: scheduler.state_dict() for name, scheduler in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.schedulers):
            raise ValidationError(f"the checkpoint holds schedulers {sorted(state)}, the job has "
                                  f"{sorted(self.schedulers)}")
        for name, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state[name])


def _normalized(path: str) -> str:
    # the same normalisation as CheckpointConfig.root: file:// dropped, a local path absolute
    text = path.removeprefix("file://")
    return (text if "://" in text else os.path.abspath(text)).rstrip("/")


class StrategyCheckpoints:
    """The dist_ckpt side of a Lightning strategy (composition: each strategy holds one).

    ``open`` builds the ``TrainState`` and its manager around the strategy's model, optimizer,
    schedulers and data position, and keeps them while those objects stay the same (a new set,
    such as the model alone for ``trainer.test``, closes the old manager first).
    ``last_update`` is the update this process saved or restored last: a second save at the same
    update is skipped (generations are immutable; the first save of an update is kept).
    """

    def __init__(self, config: CheckpointConfig, *, contract: Mapping[str, Any] | None,
                 numpy_generators: Mapping[str, np.random.Generator] | None,
                 require_optimizer_boundary: bool) -> None:
        self.config = config
        self.contract = dict(contract or {})
        self.numpy_generators = dict(numpy_generators or {})
        self.require_optimizer_boundary = require_optimizer_boundary
        self.manager: CheckpointManager | None = None
        self.state: TrainState | None = None
        self.last_update: int | None = None
        self._objects: tuple[int, ...] = ()

    @property
    def root(self) -> str:
        return self.config.root

    def open(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
             schedulers: Mapping[str, Stateful], sampler: Stateful | None) -> CheckpointManager:
        objects = (id(model), id(optimizer), id(sampler), *(id(s) for s in schedulers.values()))
        if self.manager is not None and objects == self._objects:
            return self.manager
        self.close()
        scheduler: Stateful | None = None
        if len(schedulers) == 1:
            scheduler = next(iter(schedulers.values()))
        elif schedulers:
            scheduler = NamedSchedulers(schedulers)
        self.state = TrainState(model, optimizer, scheduler=scheduler, sampler=sampler,
                                numpy_generators=self.numpy_generators, contract=self.contract,
                                extras={}, require_optimizer_boundary=self.require_optimizer_boundary)
        self.manager = CheckpointManager(self.config, self.state)
        self._objects = objects
        return self.manager

    def _opened(self) -> tuple[CheckpointManager, TrainState]:
        if self.manager is None or self.state is None:
            raise ConfigError("the strategy's checkpoint manager is not open (open() comes first)")
        return self.manager, self.state

    # ---- paths -----------------------------------------------------------------------
    def wanted(self, path: str | os.PathLike[str]) -> str | None:
        """The generation a load path names; None for the newest that validates."""
        text = os.fspath(path)
        if text == NEWEST:
            return None
        root = _normalized(self.root)
        full = _normalized(text) if parse_generation(text) is None else f"{root}/{text}"
        if full == root:
            return None
        name = full.removeprefix(root + "/")
        if full.startswith(root + "/") and parse_generation(name) is not None:
            return name
        raise ConfigError(f"{text!r} is not a checkpoint of this strategy: load its root {self.root!r}, "
                          f"{NEWEST!r}, or a generation under it (gen-N); every save goes to the root")

    def check_label(self, path: str | os.PathLike[str], update: int) -> None:
        """A save's path is a label; one that names a generation must name this update."""
        name = os.path.basename(os.fspath(path).rstrip("/"))
        number = parse_generation(name)
        if number is not None and number != update:
            raise ConfigError(f"save to {os.fspath(path)!r} at update {update}: the generation of a save "
                              f"is its update number (gen-{update:012d})")

    # ---- save, restore, finish --------------------------------------------------------
    def save(self, update: int, extras: dict[str, Any]) -> None:
        """Generation ``update`` with ``extras`` (the same on every rank) as its JSON extras."""
        manager, state = self._opened()
        if update == self.last_update:
            log.info("update %d is saved already in this run (generations are immutable); skipped", update)
            return
        check_json(extras)
        state.extras.clear()
        state.extras.update(extras)
        manager.save(update)
        self.last_update = update

    def restore(self, wanted: str | None, components: tuple[str, ...] | None = None) -> RestoreResult:
        """The newest generation that validates (``wanted``, when given, must be it)."""
        manager, _ = self._opened()
        if wanted is not None:
            newest = next((info.name for info in manager.generations() if info.state == "committed"), None)
            if newest != wanted:
                raise ConfigError(f"{wanted} is not the newest committed generation under {self.root} "
                                  f"({newest}): dist_ckpt restores the newest generation that validates")
        result = manager.restore(components=components)
        if wanted is not None and result.generation != wanted:
            raise ValidationError(f"{wanted} did not validate; restore loaded {result.generation} instead "
                                  f"(rejected: {result.rejected})", generation=wanted)
        if result.generation is not None:
            self.last_update = result.next_update
        return result

    def restored_extras(self) -> dict[str, Any]:
        """The extras ``restore`` loaded, as their save was given them."""
        _, state = self._opened()
        return dict(state.extras)

    def finish(self, update: int) -> None:
        """End the run at ``update`` (DONE.json; saved already or saved by ``finish``), then close."""
        manager, _ = self._opened()
        manager.finish(update)
        self.close()

    def close(self, *, after_error: bool = False) -> None:
        if self.manager is not None:
            self.manager.close(after_error=after_error)
        self.manager, self.state, self._objects = None, None, ()


def check_json(extras: Mapping[str, Any]) -> None:
    """Every entry must have a JSON form (dist_ckpt stores no pickle); checked on every rank
    before the save starts, so every rank raises the same error."""
    for key, value in extras.items():
        try:
            codec.encode(value)
        except TypeError as exc:
            raise ConfigError(f"checkpoint entry {key!r} cannot be saved: {exc}; dist_ckpt keeps "
                              "the non-tensor state as JSON (no pickle)") from None
