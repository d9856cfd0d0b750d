"""What the collaborators of ``CheckpointManager`` share: the job's ranks, settings, state and
tiers, frozen at construction.

The manager builds one :class:`Context` on every rank after it opened its tiers and hands it to
finish, resume, rehearse and pruning instead of itself: they read what they need and call no
method of the manager (docs/architecture.md, "The manager and its collaborators").
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import CheckpointConfig
from .protocol.comm import Comm
from .restart.state import TrainState
from .tiers.base import CommitTier
from .tiers.placement import RootGroups


@dataclass(frozen=True)
class Tiers:
    """The tiers of one job. ``root`` is ``config.root`` (the persistent root: pins, DONE,
    rehearsal records live there); ``target`` is where saves commit: the node's memory tier
    with ``memory_tier=True``, else ``root`` itself; ``mirror`` is ``config.mirror``."""

    root: CommitTier
    target: CommitTier
    mirror: CommitTier | None = None

    def newest_first(self) -> list[CommitTier]:
        """The order restore looks in: for one generation name, memory (no storage read) before
        the root, and the mirror last."""
        ordered = [self.target] if self.target is not self.root else []
        return ordered + [self.root] + ([self.mirror] if self.mirror is not None else [])

    def persistent(self) -> list[CommitTier]:
        """The tiers that outlive the job's nodes: the root and the mirror."""
        return [self.root] + ([self.mirror] if self.mirror is not None else [])


@dataclass(frozen=True)
class Context:
    comm: Comm
    config: CheckpointConfig
    state: TrainState
    tiers: Tiers
    # which ranks share a copy of the root (``tiers/placement.py``); one copy unless probed
    root_groups: RootGroups = RootGroups()

    @property
    def is_root_rank(self) -> bool:
        return self.comm.rank == 0

    @property
    def is_fs_leader(self) -> bool:
        """This rank prunes and publishes node copies for its filesystem group."""
        return self.comm.rank == self.comm.fs_leader
