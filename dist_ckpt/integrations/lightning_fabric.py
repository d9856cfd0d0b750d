"""``DistCkptFabricStrategy``: Fabric's ``ModelParallelStrategy`` (FSDP2) whose ``fabric.save`` and
``fabric.load`` are dist_ckpt generations (docs/integrations.md).

A Fabric state dict maps onto a ``TrainState`` by the type of each value: the one module is the
model, the one optimizer the optimizer, the learning-rate schedulers the scheduler, a
``ResumableLoader`` or ``ResumableSampler`` the data position; every other value is a JSON
``extras`` entry (an object with ``state_dict``/``load_state_dict`` by its state dict).
``state[update_key]`` (an int, default ``"step"``: the optimizer updates done) is the
generation's update number.

Call order (every rank, as Fabric's own ``save``/``load``): ``fabric.load(ROOT, state)`` once
after ``fabric.setup``: it restores the newest generation into the objects in place and sets
the plain entries of ``state`` (a fresh start when the root holds none: ``state`` is left as
it is and ``{}`` returned); ``fabric.save(ROOT, state)`` at optimizer boundaries (gradients
zeroed after the step); ``strategy.finish(state)`` at the end: the final generation, then
``ROOT/DONE.json``, then the manager is closed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.optim.lr_scheduler import LRScheduler

from ..config import CheckpointConfig
from ..errors import ConfigError, ValidationError
from ..restart.sampler import ResumableSampler
from ..restart.state import Stateful
from .data import ResumableLoader
from .lightning_common import StrategyCheckpoints

DATA_TYPES = (ResumableLoader, ResumableSampler)
IN_PLACE = (torch.nn.Module, torch.optim.Optimizer, LRScheduler)  # what the TrainState loads itself


@dataclass
class StateParts:
    """A Fabric state dict sorted into the ``TrainState``'s parts."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    schedulers: dict[str, Stateful] = field(default_factory=dict)
    sampler: Stateful | None = None
    sampler_key: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    update: int = 0


def _is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def split_state(state: Mapping[str, Any], update_key: str) -> StateParts:
    models = [key for key, value in state.items() if isinstance(value, torch.nn.Module)]
    optimizers = [key for key, value in state.items() if isinstance(value, torch.optim.Optimizer)]
    data = [key for key, value in state.items() if isinstance(value, DATA_TYPES)]
    for what, keys, most in (("module", models, 1), ("optimizer", optimizers, 1), ("data loader", data, 1)):
        if len(keys) > most or (what == "module" and not keys):
            raise ConfigError(f"the state holds {len(keys)} {what}(s) {keys}: a dist_ckpt TrainState holds "
                              f"{'exactly' if what == 'module' else 'at most'} one")
    update = state.get(update_key)
    if not isinstance(update, int) or isinstance(update, bool) or update < 0:
        raise ConfigError(f"state[{update_key!r}] = {update!r}: the generation's update number must be an "
                          "int >= 0 (DistCkptFabricStrategy(update_key=...) names the entry)")
    parts = StateParts(model=state[models[0]], update=update,
                       optimizer=state[optimizers[0]] if optimizers else None)
    if data:
        parts.sampler, parts.sampler_key = state[data[0]], data[0]
    for key, value in state.items():
        if key in models or key in optimizers or key in data:
            continue
        if isinstance(value, LRScheduler):
            parts.schedulers[key] = value
        else:
            parts.extras[key] = value.state_dict() if _is_stateful(value) else value
    return parts


class DistCkptFabricStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` with dist_ckpt checkpoints under
    ``checkpoint_config.root`` (see the module docstring for the mapping). ``update_key``
    names the state entry holding the update number; ``require_optimizer_boundary`` is
    ``TrainState``'s (zero the gradients after ``optimizer.step()``, or pass False when the
    gradients left at a save are no pending accumulation). The other arguments are
    ``ModelParallelStrategy``'s."""

    def __init__(self, parallelize_fn: Callable[..., torch.nn.Module],
                 checkpoint_config: CheckpointConfig | None = None, *, update_key: str = "step",
                 require_optimizer_boundary: bool = True, contract: Mapping[str, Any] | None = None,
                 numpy_generators: Mapping[str, np.random.Generator] | None = None, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise ConfigError("save_distributed_checkpoint=False: dist_ckpt always saves DCP shards "
                              "(a consolidated copy is `dist-ckpt export`)")
        super().__init__(parallelize_fn, **kwargs)
        self.checkpoint_config = checkpoint_config if checkpoint_config is not None else CheckpointConfig()
        self.checkpoints = StrategyCheckpoints(self.checkpoint_config, contract=contract,
                                               numpy_generators=numpy_generators,
                                               require_optimizer_boundary=require_optimizer_boundary)
        self.update_key = update_key

    def _open(self, state: Mapping[str, Any]) -> StateParts:
        parts = split_state(state, self.update_key)
        self.checkpoints.open(parts.model, parts.optimizer, parts.schedulers, parts.sampler)
        return parts

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any],
                        storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Generation ``state[update_key]`` under the root; ``path`` is a label."""
        if storage_options is not None:
            raise ConfigError("storage_options: set CheckpointConfig(storage_options=...) instead")
        if filter is not None:
            raise ConfigError("filter: a generation holds the whole restart state (`dist-ckpt export` "
                              "writes the weights alone)")
        parts = self._open(state)
        self.checkpoints.check_label(path, parts.update)
        self.checkpoints.save(parts.update, parts.extras)

    def load_checkpoint(self, path: str | os.PathLike[str], state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the newest generation into ``state`` (``path``: the root, ``"last"``, or the
        newest committed ``gen-N``); returns the saved entries ``state`` does not name. A fresh
        root leaves ``state`` as it is and returns ``{}``; a named generation must exist."""
        if not isinstance(state, dict):
            raise ConfigError("fabric.load(path, state) needs the state dict with the module "
                              "(dist_ckpt restores into live objects; it returns no raw checkpoint)")
        wanted = self.checkpoints.wanted(path)
        parts = self._open(state)
        result = self.checkpoints.restore(wanted)
        if result.generation is None:
            return {}
        saved = self.checkpoints.restored_extras()
        missing = []
        for key, value in state.items():
            if key == parts.sampler_key or isinstance(value, IN_PLACE):
                continue  # restored in place by the TrainState
            if key not in saved:
                missing.append(key)
            elif _is_stateful(value):
                value.load_state_dict(saved[key])
            else:
                state[key] = saved[key]
        if strict and missing:
            raise ValidationError(f"{result.generation} holds no entry {missing} of the state (strict=True)",
                                  generation=result.generation)
        return {key: value for key, value in saved.items() if key not in state}

    def finish(self, state: dict[str, Any]) -> None:
        """The run is over (every rank): the final generation ``state[update_key]`` (saved now
        unless saved already), ``ROOT/DONE.json``, then the manager is closed."""
        parts = self._open(state)
        self.checkpoints.save(parts.update, parts.extras)
        self.checkpoints.finish(parts.update)

    def teardown(self) -> None:
        self.checkpoints.close()
        super().teardown()
