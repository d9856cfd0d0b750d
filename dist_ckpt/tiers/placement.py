"""Where a job's tiers live on its nodes: which ranks share the directory saves write into,
and which ranks see the same copy of the persistent root.

Call order: ``place_tiers`` on every rank (collective) at the manager's construction, once the
tiers are open and before anything is written. It

1. creates the save target's local directory and probes which ranks see it (``Comm``'s
   filesystem groups: the leader of each publishes that group's node copy of a save);
2. removes a crashed job's leftover attempts (each group's leader; no save of this job is in
   flight yet);
3. finds the root's groups (:class:`RootGroups`). Without the memory tier the target is the
   root, so they are the filesystem groups. With it, the root is probed separately: every rank
   drops a marker in the root, and the ranks that see each other's markers share a copy. An
   object-store root is one copy;
4. refuses a root with one copy per node on more than one node when no mirror is configured
   (``check_root_groups``): losing a node would lose that node's part of every generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import logs
from ..config import CheckpointConfig
from ..errors import ConfigError
from ..protocol.comm import Comm
from ..storage.directio import filesystem_type
from ..storage.local import makedirs_durable
from .base import CommitTier

log = logs.get(__name__)


@dataclass(frozen=True)
class RootGroups:
    """Which ranks see the same copy of the root. ``leader``: the lowest rank of this rank's
    group (it publishes, prunes and writes DONE for the group's copy); ``leaders``: every
    group's leader, ascending (rank 0's group first)."""

    leader: int = 0
    leaders: tuple[int, ...] = (0,)

    @property
    def shared(self) -> bool:
        """One copy of the root serves every rank."""
        return len(self.leaders) == 1

    def copies_by(self, rank: int) -> bool:
        """``rank`` publishes a node copy: the leader of a group without rank 0."""
        return rank != 0 and rank in self.leaders


def check_root_groups(config: CheckpointConfig, groups: RootGroups) -> None:
    """Every rank, with the same groups: raise the refusal of a node-local root without a mirror."""
    if not groups.shared and config.mirror is None:
        raise ConfigError(
            f"invalid CheckpointConfig: mirror=None: required when root={config.root!r} is "
            f"node-local ({len(groups.leaders)} nodes, each with its own copy): a node's part of "
            "every generation would be lost with the node, so no restore would be possible "
            "(set mirror=s3://..., or use a root every node shares)")


def place_tiers(comm: Comm, config: CheckpointConfig, root: CommitTier, target: CommitTier) -> RootGroups:
    """All ranks (collective): see the module docstring."""
    write_root = target.local_root
    makedirs_durable(write_root)
    if comm.distributed:
        comm.probe_shared_root(write_root)
    target.local_ranks = frozenset(comm.fs_group)
    if comm.rank == comm.fs_leader:
        for tier in {id(t): t for t in (root, target)}.values():
            tier.remove_leftover_attempts()
        log.info("shard files under %s (%s) are written %s", write_root,
                 filesystem_type(write_root) or "filesystem unknown",
                 "past the page cache (O_DIRECT)" if target.direct_io else "through the page cache")
    groups = _root_groups(comm, root, target)
    comm.barrier()  # nobody writes before stale pending directories are gone
    check_root_groups(config, groups)
    return groups


def _root_groups(comm: Comm, root: CommitTier, target: CommitTier) -> RootGroups:
    if not comm.distributed or root.shared:
        return RootGroups()
    if root is target:
        leader = comm.fs_leader
    else:
        makedirs_durable(root.local_root)
        group, _ = comm.probe_group(root.local_root)
        root.local_ranks = frozenset(group)
        leader = group[0]
    leaders = tuple(sorted(set(comm.all_gather(leader))))
    return RootGroups(leader, leaders)
