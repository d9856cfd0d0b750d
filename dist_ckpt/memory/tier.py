"""The memory tier: generations in each node's shared memory (tmpfs), committed by rename.

It is a rename tier (``tiers/rename.py``: same attempt, manifest-last and rename commit,
node copies published by each filesystem group's leader) over
``<job's memory directory>/<root digest>/`` (``dist_ckpt.memory.paths``): the bytes live in RAM,
outside the worker processes, so a restarted worker finds them; fsync there costs nearly
nothing. The node's launcher owns the run directory and removes it (``launch/``).

What differs from a disk root:

- ``reshards`` is False: each node holds only its own ranks' files, so only a job of the same
  world size can find its generation again; restore skips the tier otherwise (a rejection with
  its reason) and uses the persistent root.
- ``keeps_rejected`` is False: a rejected generation is deleted, not kept aside (RAM is not
  the place for evidence; the persistent root keeps its own copy of what was persisted).
- A damaged file that restore repairs from the root or the mirror (``restore/repair.py``,
  the rename tier's ``replace_file``) is kept under this directory's ``rejected/`` (one file,
  until the launcher removes the run's directory): the generation stays in memory. A damaged
  shared object is repaired where it lies, in this directory's ``objects/``.
- Incremental generations (one node only: ``save/reuse.py``): the shared objects live in this
  directory's ``objects/``, so saves reuse what memory holds; persistence to the root copies
  an object only where the root lacks it (``RenameAttempt.put_files``), as does the launcher's
  persist at breakpoint (``memory/breakpoint.py``). Dropping or rejecting a generation never
  touches ``objects/``: retention's sweep removes what no kept generation lists.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Protocol

from .. import logs
from ..errors import ConfigError
from ..format.manifest import DCP_DIR, Manifest, dcp_entry_path, parse_generation
from ..format.validate import Problem
from ..tiers.base import GenerationReader, LocalFilesReader
from ..tiers.rename import RenameTier
from . import paths as shm

log = logs.get(__name__)


class PeerSource(Protocol):
    nodes: int

    def fetch_for_load(self, generation: str, manifest: Manifest, path: str) -> str | None: ...


class MemoryTier(RenameTier):
    kind = "memory"
    keeps_rejected = False
    reshards = False
    peers: PeerSource | None = None  # other nodes' files, for a load on more than one node

    def __init__(self, root: str, local_ranks: frozenset[int] | None = None) -> None:
        super().__init__(root, local_ranks, direct_io=False)  # tmpfs: the page cache is this tier

    def open_reader(self, generation: str, manifest: Manifest,
                    scratch_parent: str | None = None) -> GenerationReader:
        return _NodeFilesReader(self, generation, manifest)

    def move_aside(self, problem: Problem) -> str | None:
        if parse_generation(problem.generation) is None:
            return None
        path = os.path.join(self.root, problem.generation)
        if os.path.isdir(path):
            log.warning("dropping in-memory %s: %s", problem.generation, problem.reason)
            shutil.rmtree(path, ignore_errors=True)
        return None

    def drop_newer(self, generation: str | None) -> list[str]:
        """A filesystem leader after restore: delete in-memory generations newer than the one
        the job resumed from (a rejected or other-world-size timeline the job will overwrite)."""
        return remove_newer(self.root, generation)


class _NodeFilesReader(LocalFilesReader):
    """The node's copy in place; a shard file only another node holds (DCP wrote a
    replicated tensor into one rank's file) is the copy the restore exchange received
    (``memory/ring.py``). Unverified either way: the one-pass reader hashes every file it
    loads from."""

    def __init__(self, tier: MemoryTier, generation: str, manifest: Manifest) -> None:
        super().__init__(tier.store, generation, manifest,
                         os.path.join(tier.root, generation, manifest.location(DCP_DIR)))
        self.peers = tier.peers
        self.needs_local_copy = self.peers is not None and self.peers.nodes > 1

    def local_copy(self, rel: str) -> tuple[str, bool]:
        path, checked = super().local_copy(rel)
        if self.peers is not None and not os.path.exists(path):
            fetched = self.peers.fetch_for_load(self.generation, self.manifest, dcp_entry_path(rel))
            if fetched is not None:
                return fetched, False
        return path, checked


def remove_newer(root: str, generation: str | None,
                 number_of: Callable[[str], int | None] = parse_generation) -> list[str]:
    """Delete the entries of ``root`` whose generation number (``number_of`` their name) is
    above ``generation``'s (all of them when None); returns their names. A missing ``root``
    holds none."""
    resumed = None if generation is None else parse_generation(generation)
    floor = -1 if resumed is None else resumed
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    dropped = []
    for name in names:
        number = number_of(name)
        if number is not None and number > floor:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            dropped.append(name)
    return dropped


def memory_root(root: str, run_id: str | None) -> str:
    """This node's in-memory directory for checkpoint root ``root`` of launcher run ``run_id``
    (one run may checkpoint more than one root)."""
    if not run_id or not shm.valid_run_id(run_id):
        raise ConfigError("memory_tier needs the launcher's run id "
                          f"(environment variable DIST_CKPT_RUN_ID, got {run_id!r}): the node's "
                          "launcher owns and removes the shared memory (field memory_tier)")
    return os.path.join(shm.job_dir(run_id, root), shm.root_digest(root))


def open_memory_tier(root: str, run_id: str | None) -> MemoryTier:
    return MemoryTier(memory_root(root, run_id))
