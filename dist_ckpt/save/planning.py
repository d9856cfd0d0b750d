"""DCP save planning with a cache keyed by the state's layout.

Protocol (all ranks, main thread, on the checkpoint group):
``layout_fingerprint`` (local) -> agreement on the fingerprints (the manager's all-gather) ->
``SavePlanCache.prepare``: when every rank reports the cached fingerprint, the cached plan is
reused and no collective runs; otherwise local plans are gathered to rank 0, which builds the
global plan and metadata (DCP's dedup assigns replicated items to one rank), and the per-rank
plans are scattered back.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from ..protocol.comm import Comm
from ..restart.tree import walk
from .results_cache import WriteResultsCache


@torch.no_grad()  # DTensor.to_local without an autograd node per tensor
def layout_fingerprint(state: Any) -> str:
    """A digest of the keys, types, shapes, dtypes and shardings of ``state`` (not values);
    compared only with this process's own earlier fingerprints."""
    layout: list[tuple] = []
    for path, value in walk(state):
        if isinstance(value, DTensor):
            layout.append((path, "D", tuple(value.shape), value.dtype, value.placements,
                           tuple(value.to_local().shape)))
        elif isinstance(value, torch.Tensor):
            layout.append((path, "T", tuple(value.shape), value.dtype))
        elif isinstance(value, list | tuple):
            layout.append((path, "L", len(value)))
        elif not isinstance(value, dict):
            layout.append((path, "O"))
    return hashlib.sha256(repr(layout).encode()).hexdigest()


@dataclass
class PreparedSave:
    planner: DefaultSavePlanner
    plan: SavePlan
    metadata: Metadata | None  # rank 0 only; a private copy per save
    reused: bool
    # what the saves under this plan repeat (every rank's write results, rank 0's .metadata)
    results: WriteResultsCache = field(default_factory=WriteResultsCache)


class SavePlanCache:
    """Caches the final per-rank plan and the global metadata for one layout."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.fingerprint: str | None = None
        self._plan: SavePlan | None = None
        self._metadata: Metadata | None = None
        self.planning_rounds = 0
        self.plan_bytes: int | None = None  # tensor bytes this rank writes under the cached plan
        self.results = WriteResultsCache()

    def written_fqns(self, fingerprint: str) -> frozenset[str] | None:
        """The state-dict keys this rank writes under the cached plan, when that plan is for
        ``fingerprint``; None otherwise (the next save plans again)."""
        if self._plan is None or fingerprint != self.fingerprint:
            return None
        return frozenset(item.index.fqn for item in self._plan.items)

    def clear(self) -> None:
        """Forget the cached plan (the next ``prepare`` plans again on every rank)."""
        self.fingerprint, self._plan, self._metadata, self.plan_bytes = None, None, None, None
        self.results.clear()

    def prepare(self, state: Any, fingerprint: str, all_cached: bool) -> PreparedSave:
        """All ranks call this together; ``all_cached`` must be the agreed value."""
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=self.comm.rank == 0)
        if all_cached and self._plan is not None:
            return PreparedSave(planner, self._plan, copy.copy(self._metadata), reused=True,
                                results=self.results)
        local_plan = planner.create_local_plan()
        all_plans = self.comm.gather(local_plan)
        global_plans: list[SavePlan] | None = None
        metadata: Metadata | None = None
        if self.comm.rank == 0:
            assert all_plans is not None
            global_plans, metadata = planner.create_global_plan(all_plans)
            global_plans = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
                            for i, p in enumerate(global_plans)]
        final_plan = planner.finish_plan(self.comm.scatter(global_plans))
        self.fingerprint, self._plan, self._metadata = fingerprint, final_plan, metadata
        self.plan_bytes = plan_bytes(final_plan)
        self.planning_rounds += 1
        return PreparedSave(planner, final_plan, copy.copy(metadata), reused=False, results=self.results)


def plan_bytes(plan: SavePlan) -> int:
    """Tensor bytes a per-rank plan writes (DCP dedup already removed replicated copies)."""
    return sum(item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
               for item in plan.items if item.tensor_data is not None)
