"""Load targets for a fresh optimizer's state, allocated from the generation's DCP metadata.

``get_state_dict`` on an optimizer that has no state yet (a restarted process) creates it by
running one optimizer step on zero gradients (torch's ``_init_optim_state``): the full
update math over every parameter, only to obtain tensors the load then overwrites. On a
restart that work grows with the optimizer state and can be a large share of the restore
(docs/performance.md). When the generation's metadata describes, for every
trainable parameter of the optimizer, state entries that are tensors of the parameter's own
global shape or scalars, this module allocates those targets directly (``empty_like`` of the
parameter keeps its sharding, so a resharded load works the same). Anything else (a
parameter without saved state, a non-tensor entry, another shape, a shared parameter) keeps
torch's path, untouched.

Call order (all ranks, ``restore.loader.load_generation``): ``prebuild`` once the
generation's metadata is read and before ``TrainState.tensor_state``; ``discard`` when that
load fails, so the optimizer is left exactly as it was (without state) for the next
candidate generation or a fresh start. The ranks decide independently but identically:
every rank reads the same metadata and holds the same parameter names.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import logs
from ..restart.state import TrainState

log = logs.get(__name__)
STATE_PREFIX = "optim.state."  # TrainState.tensor_state's "optim" key, DCP-flattened


def prebuild(state: TrainState, metadata: Metadata, components: Iterable[str]) -> list[torch.Tensor]:
    """Give a stateless optimizer its state entries as uninitialised load targets. Returns
    the parameters that received state (empty when torch's own initialisation is kept)."""
    optimizer = state.optimizer
    if optimizer is None or "optimizer" not in set(components) or optimizer.state:
        return []
    saved = _saved_entries(state.model, optimizer, metadata)
    if saved is None:
        return []
    for param, entries in saved.items():
        optimizer.state[param] = {name: _target(param, meta) for name, meta in entries.items()}
    return list(saved)


def discard(state: TrainState, params: list[torch.Tensor]) -> None:
    """Take back what ``prebuild`` gave (the load failed): the optimizer has no state again."""
    if state.optimizer is not None:
        for param in params:
            state.optimizer.state.pop(param, None)


def _saved_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   metadata: Metadata) -> dict[torch.Tensor, dict[str, TensorStorageMetadata]] | None:
    try:  # torch's own parameter-name canonicalisation (DDP, compile and FSDP prefixes)
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # pragma: no cover - a torch without it keeps its own path
        return None
    saved: dict[str, dict[str, object]] = defaultdict(dict)
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(STATE_PREFIX):
            fqn, _, entry = key[len(STATE_PREFIX):].rpartition(".")
            saved[fqn][entry] = meta
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    found: dict[torch.Tensor, dict[str, TensorStorageMetadata]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue
            known = names.get(id(param), [])
            fqns = _get_fqns(model, known[0]) if len(known) == 1 else set()  # not shared
            entries = saved.get(next(iter(fqns))) if len(fqns) == 1 else None
            if not entries or param in found or not all(_fits(param, m) for m in entries.values()):
                return None
            found[param] = entries  # type: ignore[assignment]
    return found or None


def _fits(param: torch.Tensor, meta: object) -> bool:
    return isinstance(meta, TensorStorageMetadata) and (
        tuple(meta.size) == tuple(param.shape) or len(meta.size) == 0)


def _target(param: torch.Tensor, meta: TensorStorageMetadata) -> torch.Tensor:
    dtype = meta.properties.dtype
    if len(meta.size) == 0 and param.dim() != 0:  # a per-parameter scalar such as Adam's step
        return torch.zeros((), dtype=dtype)
    with torch.no_grad():
        return torch.empty_like(param, dtype=dtype, requires_grad=False)
