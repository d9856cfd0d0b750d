"""``TrainState``: everything a faithful restart needs, gathered from live objects.

Tensor state (model, optimizer) goes through ``torch.distributed.checkpoint.state_dict``
so plain, DDP and FSDP2 models share one key space and reshard on load. The small global
state (scheduler, scaler, counters, data position, extras) and the per-rank RNG state are
JSON documents (see :mod:`dist_ckpt.codec`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..errors import NotAtOptimizerBoundary, ValidationError
from . import contract as contract_mod
from . import rng
from .statedict import StateDictReader

ALL_COMPONENTS = ("model", "optimizer", "scheduler", "scaler", "data", "rng", "extras")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainState:
    """The restart state of one rank of a training job.

    ``numpy_generators`` names every ``numpy.random.Generator`` the job draws from (the
    legacy global state does not cover them). ``contract`` maps field names (config,
    tokenizer, data) to digest strings or values that are digested as canonical JSON (sets,
    dataclasses, pydantic models, enums, paths and small arrays included; anything else
    raises ``ConfigError``). ``extras`` is a JSON-able dict (best metric, EMA step, tracker
    run id, ...), the same on every rank.
    ``require_optimizer_boundary=False`` declares that gradients left on parameters at save
    time are not a pending accumulation.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 scheduler: Stateful | None = None, scaler: Stateful | None = None,
                 sampler: Stateful | None = None,
                 numpy_generators: Mapping[str, np.random.Generator] | None = None,
                 contract: Mapping[str, Any] | None = None,
                 extras: dict[str, Any] | None = None,
                 require_optimizer_boundary: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.numpy_generators = dict(numpy_generators or {})
        # built here, on every rank: a value with no canonical form is refused before any
        # manager exists (ConfigError naming its key path)
        self.contract_spec = contract_mod.build(contract)
        self.contract = self.contract_spec.digests
        self.extras: dict[str, Any] = extras if extras is not None else {}
        self.require_optimizer_boundary = require_optimizer_boundary
        self.next_update = 0
        self.tokens_seen = 0
        self._state_dicts: StateDictReader | None = None  # keeps get_state_dict's preparation

    @property
    def components(self) -> tuple[str, ...]:
        present = {"model": True, "optimizer": self.optimizer is not None,
                   "scheduler": self.scheduler is not None, "scaler": self.scaler is not None,
                   "data": self.sampler is not None, "rng": True, "extras": True}
        return tuple(name for name in ALL_COMPONENTS if present[name])

    # ---- save side -------------------------------------------------------------------
    def at_optimizer_boundary(self) -> bool:
        """False when a parameter still holds a non-zero gradient (pending accumulation)."""
        if not self.require_optimizer_boundary:
            return True
        for param in self.model.parameters():
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel() and bool(local.ne(0).any()):
                return False
        return True

    def check_boundary(self) -> None:
        if not self.at_optimizer_boundary():
            raise NotAtOptimizerBoundary(
                "save requested mid gradient accumulation: a parameter still holds a gradient "
                "after the optimizer step; save only at optimizer boundaries (zero the gradients "
                "after step) or pass require_optimizer_boundary=False"
            )

    def tensor_state(self, components: Iterable[str] | None = None) -> dict[str, Any]:
        """Model and optimizer state dicts (live references; all ranks call this)."""
        wanted = set(self.components if components is None else components)
        if self.optimizer is not None and "optimizer" in wanted:
            if self._state_dicts is None or self._state_dicts.optimizer is not self.optimizer \
                    or self._state_dicts.model is not self.model:
                self._state_dicts = StateDictReader(self.model, self.optimizer)
            model_sd, optim_sd = self._state_dicts.read()
            return {"model": model_sd, "optim": optim_sd}
        return {"model": get_model_state_dict(self.model, options=StateDictOptions())}

    def global_state(self) -> dict[str, Any]:
        """Rank-independent small state, written once by rank 0."""
        return {
            "next_update": self.next_update,
            "tokens_seen": self.tokens_seen,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": self.sampler.state_dict() if self.sampler is not None else None,
            "extras": self.extras,
        }

    def rank_state(self) -> dict[str, Any]:
        """Per-rank state: every random source of this rank."""
        return {"rng": rng.capture(self.numpy_generators)}

    # ---- load side (order: tensors, global, then RNG last) ---------------------------
    def load_tensor_state(self, loaded: dict[str, Any]) -> None:
        options = StateDictOptions()
        if "optim" in loaded and self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"], options=options)
        else:
            set_model_state_dict(self.model, loaded["model"], options=options)

    def load_global_state(self, saved: dict[str, Any], components: Iterable[str]) -> None:
        wanted = set(components)
        self.next_update = int(saved["next_update"])
        self.tokens_seen = int(saved["tokens_seen"])
        pairs = (("scheduler", self.scheduler), ("scaler", self.scaler), ("data", self.sampler))
        for name, target in pairs:
            if name not in wanted or target is None:
                continue
            if saved.get(name) is None:
                raise ValidationError(f"checkpoint holds no {name} state but the job has one")
            target.load_state_dict(saved[name])
        if "extras" in wanted:
            self.extras.clear()
            self.extras.update(saved.get("extras") or {})

    def load_rank_state(self, saved: dict[str, Any]) -> None:
        rng.restore(saved["rng"], self.numpy_generators)
