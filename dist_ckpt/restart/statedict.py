"""Model and optimizer state dicts through torch's distributed state-dict API, with the API's
per-model preparation kept from one save to the next.

``get_state_dict`` starts every call by mapping each parameter to its fully qualified names,
finding shared parameters and FSDP modules (``_verify_options``): a large share of its time,
growing with the parameter count (docs/performance.md), for a result that changes only when
the parameters do. ``StateDictReader``
keeps that result while the model's and the optimizer's parameters are the same objects, and
runs the rest exactly as torch does on every call (the model's ``state_dict``, the optimizer's,
the consistency check), so whatever changes between saves (buffers, the learning rate, step
counters) is read fresh. The kept result holds the parameters it maps, so a replaced
parameter can never share an ``id`` with the one it replaced.

Where torch's private pieces are missing (another release), it calls ``get_state_dict``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

_PRIVATE = ("_verify_options", "_get_model_state_dict", "_get_optim_state_dict", "_verify_state_dict")
_HAS_PRIVATE = all(hasattr(torch_state_dict, name) for name in _PRIVATE)


class StateDictReader:
    """``get_state_dict(model, optimizer)`` for one model and optimizer pair (any rank, as
    often as saves happen; every rank calls it for each save, as ``get_state_dict``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = StateDictOptions()
        self._info: Any = None
        self._key: tuple[int, ...] = ()
        self._private = True  # False once torch's private pieces turned out to differ

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if _HAS_PRIVATE and self._private:
            try:
                return self._read_keeping_preparation()
            except TypeError:
                # a torch release whose private signatures differ: its public API from now on
                self._private = False
        return get_state_dict(self.model, self.optimizer, options=self.options)

    def _read_keeping_preparation(self) -> tuple[dict[str, Any], dict[str, Any]]:
        key = self._parameters_key()
        gc_context = getattr(torch_state_dict, "_gc_context", contextlib.nullcontext)
        with gc_context():
            if self._info is None or key != self._key:
                self._info = torch_state_dict._verify_options(
                    self.model, (self.optimizer,), optim_only=False, options=self.options)
                self._key = key
            model_sd = torch_state_dict._get_model_state_dict(self.model, self._info)
            optim_sd = torch_state_dict._get_optim_state_dict(self.model, (self.optimizer,), self._info)
            torch_state_dict._verify_state_dict(model_sd, optim_sd, self._info)
        return model_sd, optim_sd

    def _parameters_key(self) -> tuple[int, ...]:
        """Identity of every parameter the preparation maps, the model's then the optimizer's
        (a reader serves one model and one optimizer: ``TrainState`` makes a new one for others)."""
        named = [id(p) for p in self.model.parameters()]
        grouped = [id(p) for group in self.optimizer.param_groups for p in group["params"]]
        return (len(named), *named, *grouped)
