"""Repair at restore: one damaged or missing file of a generation is replaced by a good copy
of the same save from another tier, so restore loads that generation instead of passing it
over for an older one.

When selection (``select_generation``) or the load (``resume``) rejects generation G in tier
T because of one named file, the :class:`Repairer` looks for G in the other tiers, nearest
first: the node's memory, the root, the mirror (``Tiers.newest_first`` without T). A peer
node's memory is not a source (the ring completes node copies before selection, and a file
damaged there is read from the root or the mirror instead). A source counts only when its
manifest has the same :meth:`~dist_ckpt.format.manifest.Manifest.identity` as T's: the same
save, never a re-save of the update number. Its copy of the file is streamed into a private
directory on T's filesystem, checked against T's manifest entry (size and digest), and then
installed in place by T (``FileRepairs.replace_file``): the damaged copy goes to
``ROOT/rejected/<G>-files-<time>-<id>/`` with a reason. A shared object of incremental
generations (``objects/<name>``) is repaired the same way, per object, where it lies
(``ROOT/objects/<name>``): one repair serves every generation that references it. Its name is
its digest, so the source is the other tier's ``objects/<name>`` whatever generations that
tier holds (its bytes are checked against T's entry all the same). Before any other tier, a
shared object's first source is its second copy on T itself (``objects-copy/<name>``, which
a root without a mirror keeps: ``CheckpointConfig.object_copies``, docs/incremental.md), so
a root alone recovers from one damaged object. A damaged shared object that no tier holds a
good copy of (nor T's second copy) is moved aside all the same (no
generation listing it can load; a later replay must not find it and reference it again), and
restore falls back past every generation that lists it. A tier without ``FileRepairs`` (an
object-store root) is never repaired in place; restore then reads G from another tier or
falls back, as before.

Call order (all ranks, main thread, with a problem every rank agreed on: selection's and the
load's verdicts are all-gathered): ``repairer(T, problem)``. The ranks that hold T's copy
(each filesystem leader for the save target, each with its node's copy; rank 0 for any other
tier) check their copy of the file and repair it when it is bad; then one all-gather of their
outcomes, so every rank returns the same answer and records the same ``RepairedFile``. True
means: every holder's copy is good now, validate (or load) G in T again. Each (G, T, file) is
tried once per restore, so a file that fails again is not fetched in a loop.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

from .. import logs
from ..context import Tiers
from ..digests import hasher
from ..errors import DistCkptError, ValidationError
from ..format.manifest import (
    COMMON_FILES,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    is_object_path,
    regular_file_size,
)
from ..format.objects import copy_path
from ..format.validate import Problem, check_digests, check_entry, read_manifest
from ..protocol.comm import Comm
from ..storage.base import StoreReader
from ..storage.directio import durable_file
from ..tiers.base import CommitTier, FileRepairs

log = logs.get("dist_ckpt.manager")
READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class RepairedFile:
    """One file of ``generation`` that restore replaced with a verified copy."""

    generation: str
    path: str
    source: str  # the tier it came from: "memory", "root" or "mirror"; "root's second copy"
    reason: str  # why the replaced copy was rejected
    kept: str | None = None  # where the damaged copy went (None: it was missing)


def repair_summary(repaired: list[RepairedFile]) -> str | None:
    """``repaired N file(s) of gen-... from <tier>`` (one clause per generation); None when
    nothing was repaired."""
    clauses = []
    for generation in dict.fromkeys(r.generation for r in repaired):
        mine = [r for r in repaired if r.generation == generation]
        sources = " and ".join(dict.fromkeys(r.source for r in mine))
        clauses.append(f"repaired {len(mine)} file(s) of {generation} from {sources}")
    return "; ".join(clauses) or None


class Repairer:
    """Repairs for one restore (see the module docstring); ``repaired`` lists what it did,
    the same on every rank."""

    def __init__(self, comm: Comm, tiers: Tiers, key: bytes | None) -> None:
        self.comm = comm
        self.tiers = tiers
        self.key = key
        self.repaired: list[RepairedFile] = []
        self._tried: set[tuple[str, str, str]] = set()

    def role(self, tier: CommitTier) -> str:
        if tier is self.tiers.mirror:
            return "mirror"
        return "root" if tier is self.tiers.root else "memory"

    def __call__(self, tier: CommitTier, problem: Problem) -> bool:
        """All ranks, with the same agreed ``problem`` of ``tier``: True when the file it
        names was repaired on every rank that holds ``tier``'s copy."""
        path = problem.path
        if (path is None or path == MANIFEST_NAME or problem.signature
                or not isinstance(tier, FileRepairs)
                or (problem.generation, tier.url, path) in self._tried):
            return False  # the same inputs on every rank: all skip the all-gather together
        self._tried.add((problem.generation, tier.url, path))
        holder = self.comm.rank == (self.comm.fs_leader if tier is self.tiers.target else 0)
        outcome = None
        if holder:
            try:
                outcome = self._repair_here(tier, problem.generation, path, problem.reason)
            except Exception as exc:  # noqa: BLE001 - a holder that raised would leave the all-gather
                outcome = ("failed", f"{type(exc).__name__}: {exc}", None)
        outcomes = [o for o in self.comm.all_gather(outcome) if o is not None]
        failed = [o[1] for o in outcomes if o[0] == "failed"]
        fixed = [o for o in outcomes if o[0] == "repaired"]
        if failed or not fixed:
            if self.comm.rank == 0 and failed:
                log.warning("cannot repair %s/%s in %s: %s", problem.generation, path,
                            self.role(tier), failed[0])
            return False
        _, source, kept = fixed[0]
        done = RepairedFile(problem.generation, path, source, problem.reason, kept)
        self.repaired.append(done)
        if self.comm.rank == 0:
            log.warning("repaired %s/%s in %s from %s (%s)%s", problem.generation, path,
                        self.role(tier), source, problem.reason,
                        f"; the damaged copy is in {kept}" if kept else "")
        return True

    def _repair_here(self, tier: CommitTier, generation: str, path: str,
                     reason: str) -> tuple[str, str | None, str | None]:
        """A holder of ``tier``'s copy: ("repaired", source, kept), ("intact"|"absent", None,
        None) or ("failed", why, None). Never raises: every holder reaches the all-gather."""
        try:
            if not tier.store.exists(f"{generation}/{MANIFEST_NAME}"):
                return "absent", None, None  # a node-local copy this node never got
            manifest = read_manifest(tier.store, generation, key=self.key)
        except (DistCkptError, OSError) as exc:
            return "failed", f"its manifest is unreadable ({exc})", None
        entry = manifest.file(path)
        if entry is None:
            return "failed", f"the manifest lists no {path}", None
        if tier.local_ranks is not None and entry.rank not in tier.local_ranks \
                and path not in COMMON_FILES:
            return "absent", None, None  # another node's file: that node's leader repairs it
        try:
            check_digests(tier.store, generation, manifest, [path])
            return "intact", None, None  # this node's copy is good: another node's was not
        except (DistCkptError, OSError):
            pass
        assert isinstance(tier, FileRepairs)
        for label, store, rel in self._sources(tier, generation, manifest, entry):
            scratch = self._fetch(label, store, rel, tier, generation, entry)
            if scratch is None:
                continue
            try:
                kept = tier.replace_file(generation, manifest, path, os.path.join(scratch, path), reason)
            except (DistCkptError, OSError) as exc:
                return "failed", f"cannot install the copy from {label}: {exc}", None
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return "repaired", label, kept
        if is_object_path(path):
            self._set_aside(tier, generation, manifest, path, reason)
        return "failed", "no other tier holds a good copy of the same save", None

    def _set_aside(self, tier: FileRepairs, generation: str, manifest: Manifest, path: str,
                   reason: str) -> None:
        """A damaged shared object no tier holds a good copy of: every generation that lists
        it fails (restore falls back past them all), and left in place it would be referenced
        again, unread, by a replay that finds it with the right size. Moved aside instead
        (kept under ``rejected/``), so a later save or replay writes it anew."""
        try:
            tier.replace_file(generation, manifest, path, None, reason)
        except (DistCkptError, OSError) as exc:
            log.warning("cannot move the damaged %s of %s aside: %s", path, self.role(tier), exc)

    def _sources(self, tier: CommitTier, generation: str, manifest: Manifest,
                 entry: FileEntry) -> Iterator[tuple[str, StoreReader, str]]:
        """Each candidate copy of ``entry`` as (label, store, path in that store), nearest first.
        A shared object's second copy on ``tier`` itself (``objects-copy/<name>``, written with
        it where no mirror holds the objects: ``CheckpointConfig.object_copies``) comes first:
        on the same filesystem, and without it a root alone would have no source at all. Then
        the other tiers (memory, root, mirror). A shared object is named by its digest:
        another tier's ``objects/<name>`` serves whichever of its generations lists it, or
        none; any other file only from a copy of the same save (the same ``identity()``)."""
        if is_object_path(entry.path):
            second = copy_path(entry.path)
            if tier.store.exists(second):
                yield f"{self.role(tier)}'s second copy", tier.store, second
        for source in (t for t in self.tiers.newest_first() if t is not tier):
            if is_object_path(entry.path):
                yield self.role(source), source.store, entry.path
                continue
            try:
                theirs = read_manifest(source.store, generation, key=self.key)
            except (DistCkptError, OSError):
                continue  # not there, or not trusted
            if theirs.identity() != manifest.identity():
                log.info("%s in %s is another save of that update: not a source for %s",
                         generation, self.role(source), entry.path)
                continue
            yield self.role(source), source.store, theirs.where(entry.path)

    def _fetch(self, label: str, store: StoreReader, rel: str, tier: FileRepairs, generation: str,
               entry: FileEntry) -> str | None:
        """``store``'s ``rel`` copied into a new directory from ``tier.repair_dir``, checked
        against ``entry`` (size and digest); None when it is not a good copy."""
        try:
            scratch = tier.repair_dir(generation)
        except OSError as exc:
            log.warning("cannot repair %s/%s: %s", generation, entry.path, exc)
            return None
        try:
            copy_checked(store, rel, os.path.join(scratch, entry.path), entry, generation)
        except (DistCkptError, OSError) as exc:
            log.info("%s holds no good copy of %s/%s: %s", label, generation, entry.path, exc)
            shutil.rmtree(scratch, ignore_errors=True)
            return None
        return scratch


def copy_checked(store: StoreReader, rel: str, target: str, entry: FileEntry, generation: str) -> None:
    """Stream ``rel`` from ``store`` into a new durable file ``target``, hashing on the way;
    raises ``ValidationError`` (naming the file) unless size and digest match ``entry``.
    Never more than ``entry.size`` bytes are written."""
    regular_file_size(store, rel, generation=generation, path=entry.path)  # never a FIFO or link
    digest, received = hasher(entry.algorithm), 0
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with store.open_read(rel) as stream, durable_file(target, direct=False) as sink:
        while chunk := stream.read(READ_CHUNK):
            received += len(chunk)
            if received > entry.size:
                break
            digest.update(chunk)
            sink.write(memoryview(chunk))
    if received > entry.size:
        raise ValidationError(f"{generation}: file {entry.path} is longer than its manifest entry",
                              generation=generation, path=entry.path)
    check_entry(generation, entry.path, entry, received, digest.hexdigest())
