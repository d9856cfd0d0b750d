"""The commit-tier protocol: how a generation is written, committed and read in one place.

A tier is where generations live (a POSIX directory, an object store; later the memory of
each node). Everything outside ``dist_ckpt.tiers`` talks to a :class:`CommitTier` and never
asks which kind it is; what differs between kinds is a method of the tier or of its
:class:`Attempt`.

Call order of one save attempt of generation G (see docs/architecture.md, "Save"):
1. every rank: ``attempt = tier.begin(G, attempt_id)`` with the ``attempt_id`` rank 0 chose
   and every rank received in the save agreement; the rank writes its files (DCP shards,
   its state file) below ``attempt.local_dir``, then ``attempt.put_files(entries)``;
2. rank 0, after every rank reported: writes DCP's ``.metadata`` below ``local_dir``,
   ``attempt.put_files([metadata])``, then ``attempt.publish(manifest, key)``: the manifest
   becomes visible last, the generation is validated, then ``latest.json`` moves. On any
   failure rank 0 calls ``attempt.abandon()`` instead, and the attempt leaves no generation;
3. the leader of each filesystem group without rank 0 (tiers with ``shared = False`` only):
   ``attempt.publish_copy(manifest_raw)``;
4. every rank other than 0: ``attempt.release(entries, committed)`` once the outcome is known
   (rank 0 releases its own after publishing).
A replay (the mirror) is the same sequence with ``begin(G, attempt_id, source_dir=...)``:
the files are read from an already committed generation, which ``release`` leaves alone.

Reads: ``tier.store`` (a :class:`~dist_ckpt.storage.base.Store`) for validation, inventory
and retention; ``tier.open_reader(G, manifest)`` for what DCP loads.
"""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint.metadata import Metadata

from .. import logs
from ..errors import ConfigError, ValidationError
from ..format.manifest import (
    DCP_DIR,
    MANIFEST_NAME,
    METADATA_FILE,
    OBJECTS_DIR,
    PENDING_PREFIX,
    STATE_DIR,
    Manifest,
    RejectedEntry,
    parse_generation,
)
from ..format.validate import Problem, read_verified
from ..storage.base import Store, StoreReader

log = logs.get(__name__)


# ---- one name per attempt ----------------------------------------------------------------
def attempt_prefix(attempt_id: str) -> str:
    """Where an attempt's objects live inside the generation on a store without rename."""
    return f"attempt-{attempt_id}"


# ---- protocols ------------------------------------------------------------------------------
class GenerationReader(Protocol):
    """What DCP reads one committed generation through. Construct per load on every rank;
    ``close()`` afterwards on every rank."""

    storage_reader: StorageReader
    # True: every byte DCP reads is checked against the manifest as it arrives (a mismatch
    # lands in ``errors``); False: the caller checks the digests of what it reads first
    hashes_on_read: bool
    # True: some file may be elsewhere (another node's memory): only ``local_copy`` brings
    # it, so a load goes through the one-pass reader, which calls it for every file
    needs_local_copy: bool
    errors: list[ValidationError]

    def read_metadata(self) -> Metadata: ...

    def local_copy(self, rel: str) -> tuple[str, bool]:
        """A local path holding ``dcp/<rel>`` (the file itself, or a private copy) and whether
        its bytes were checked against the manifest on the way there."""

    def close(self) -> None: ...


class Attempt(Protocol):
    generation: str
    attempt_id: str
    local_dir: str  # this rank writes its files here (a private local directory)
    data_dir: str  # where the files live inside the generation ("" = at its top)
    shared: bool  # the tier's: False when each filesystem group publishes its own copy
    direct_io: bool  # the tier's: the writer may send this attempt's files past the page cache

    def put_files(self, entries: list[dict]) -> None:
        """Every rank, for its own files (FileEntry fields) below ``local_dir``."""

    def publish(self, manifest: Manifest, signing_key: bytes | None) -> bytes:
        """Rank 0: commit ``manifest`` (signature first, manifest last, validate, latest);
        returns the manifest bytes. Raises ``GenerationExists`` when G is committed already."""

    def publish_copy(self, manifest_raw: bytes) -> None:
        """A filesystem leader without rank 0 (tiers with ``shared = False``): commit this
        node's copy of a generation rank 0 committed."""

    def release(self, entries: list[dict], committed: bool) -> None:
        """Any rank, once the outcome is known: drop this rank's local bytes that the tier
        no longer needs (all of them from scratch; only a failed attempt's in place)."""

    def abandon(self) -> None:
        """Rank 0, on failure: remove everything the attempt wrote, here and remotely."""


class CommitTier(Protocol):
    url: str  # for messages and the ``tier`` of a rejection
    store: Store
    shared: bool  # one copy serves every rank; False: each filesystem group holds its own
    local_root: str  # the local directory below which this node's attempts are written
    # ranks whose files this node's copy holds; set once the filesystem groups are known
    local_ranks: frozenset[int] | None
    kind: str  # a word for people ("local", "object store"); never branched on
    leaves_debris: bool  # failed attempts leave bytes behind that only retention removes
    keeps_rejected: bool  # move_aside keeps rejected generations under ``rejected/``
    # restore may load a generation of another world size from here (False: the memory tier,
    # whose per-node copies only a job of the same shape finds again)
    reshards: bool
    # incremental generations: shared objects below the root, each written once and listed by
    # every generation that holds it (format/objects.py); False: one copy per generation
    shares_objects: bool
    # files written under local_root bypass the page cache (O_DIRECT): True where they stay on
    # a local disk until a restore (CheckpointConfig.direct_io decides); False where they are
    # memory already (tmpfs) or are read back at once (an object store's upload scratch)
    direct_io: bool

    def begin(self, generation: str, attempt_id: str, *, source_dir: str | None = None) -> Attempt: ...

    def open_reader(self, generation: str, manifest: Manifest,
                    scratch_parent: str | None = None) -> GenerationReader: ...

    def remove_leftover_attempts(self) -> None:
        """A filesystem leader at start-up, before any save of this job: remove them."""

    def debris(self, committed: dict[str, Manifest], uncommitted: list[str]) -> list[str]:
        """What retention may delete besides old generations: paths of failed attempts'
        leftovers (``uncommitted`` lists generations without a valid manifest)."""

    def move_aside(self, problem: Problem) -> str | None:
        """Move a rejected generation out of the job's way, keeping its bytes; returns where
        it went, or None when this tier keeps nothing aside (it is left in place)."""


@runtime_checkable
class FileRepairs(Protocol):
    """A tier whose committed generation can get one damaged or missing file replaced by a
    good copy of the same save (``dist_ckpt.restore.repair``); a tier without these methods
    is never repaired in place (an object-store root: restore reads another tier instead).

    Call order (the ranks that hold the tier's copy: each filesystem leader, or rank 0 for
    the root behind the memory tier; at restore, before any save of the job):
    ``scratch = repair_dir(G)``; the caller writes the verified bytes below ``scratch``;
    ``replace_file(G, manifest, path, scratch/path, reason)``; the caller removes ``scratch``."""

    def repair_dir(self, generation: str) -> str:
        """A new private local directory on the tier's own filesystem (so the install is a
        rename); a crash leaves it for the start-up sweep of leftover attempts."""

    def replace_file(self, generation: str, manifest: Manifest, path: str, fresh: str | None,
                     reason: str) -> str | None:
        """Install ``fresh`` (already verified against ``manifest``) as ``path`` of committed
        ``generation`` (a shared object: at the root's ``objects/``); the damaged copy, when
        there is one, is moved aside with ``reason`` first. ``fresh`` None: only move the
        damaged copy aside (an object no tier holds intact). Returns where it went (None:
        the file was missing)."""


@runtime_checkable
class PutsBack(Protocol):
    """A tier that keeps quarantined generations (``keeps_rejected``) and can return one to the
    root (``dist-ckpt unquarantine``, an operator's act; the job never calls it)."""

    def put_back(self, entry: RejectedEntry, check: Callable[[StoreReader], Any]) -> str:
        """Make quarantined generation ``entry`` the committed generation of its name again,
        its bytes unchanged, and return where it is. ``check(view)`` validates (raising) the
        bytes that become the generation before any of them is visible under its name.
        ``GenerationExists`` when something holds the name: nothing there is replaced. The
        latest pointer is the caller's."""


# ---- shared pieces of the implementations -------------------------------------------------
class LocalFilesReader:
    """A :class:`GenerationReader` over a generation's DCP files in a local directory: the
    metadata is unpickled only from bytes that matched the manifest; shards are read in place
    (``hashes_on_read`` is False: a caller that needs more than restore's validation hashes
    the shards it reads first)."""

    hashes_on_read = False
    needs_local_copy = False

    def __init__(self, store: StoreReader, generation: str, manifest: Manifest, dcp_dir: str) -> None:
        self.store = store
        self.generation = generation
        self.manifest = manifest
        self.errors: list[ValidationError] = []
        self.dcp_dir = dcp_dir
        self._metadata: Metadata | None = None
        self.storage_reader: StorageReader = _VerifiedMetadataReader(dcp_dir, self)

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            raw = read_verified(self.store, self.generation, self.manifest, METADATA_FILE)
            metadata = pickle.loads(raw)  # noqa: S301 - its sha256 matched the manifest
            if not isinstance(metadata, Metadata):
                raise ValidationError(f"{self.generation}: {METADATA_FILE} is not DCP metadata",
                                      generation=self.generation, path=METADATA_FILE)
            self._metadata = metadata
        return self._metadata

    def local_copy(self, rel: str) -> tuple[str, bool]:
        """``dcp/<rel>`` in place (unverified: the one-pass reader hashes it)."""
        return os.path.join(self.dcp_dir, rel), False

    def close(self) -> None:
        pass


class _VerifiedMetadataReader(FileSystemReader):
    """DCP's local reader, serving the metadata its owner verified (DCP would otherwise
    unpickle ``.metadata`` from disk again on every load)."""

    def __init__(self, path: str, owner: LocalFilesReader) -> None:
        super().__init__(path)
        self._owner = owner

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._owner.read_metadata()


def remove_own_files(local_dir: str, entries: list[dict], *, remove_dirs: bool = True) -> None:
    """Remove this rank's files below ``local_dir`` and (``remove_dirs``) the directories left
    empty. A rank that fails while its peers may still be writing keeps the directories: an
    empty ``dcp/`` is a peer's next destination, and the failed attempt's directory goes with
    ``abandon`` (rank 0) or the next start's stale-attempt sweep."""
    for entry in entries:
        try:
            os.unlink(os.path.join(local_dir, entry["path"]))
        except FileNotFoundError:
            pass
    if not remove_dirs:
        return
    for directory in (DCP_DIR, STATE_DIR, OBJECTS_DIR, ""):
        try:
            os.rmdir(os.path.join(local_dir, directory))
        except OSError:
            pass


def stale_uncommitted(committed: dict[str, Manifest], uncommitted: list[str]) -> list[str]:
    """Generations without a valid manifest that are older than the newest committed one
    (newer ones may still be in flight): what a failed attempt or a cut-short prune left."""
    if not committed:
        return []
    newest = max(parse_generation(name) or 0 for name in committed)
    return [name for name in uncommitted if (parse_generation(name) or 0) < newest]


def orphan_attempts(store: StoreReader, committed: dict[str, Manifest]) -> list[str]:
    """Children of committed generations that their manifest does not reference (the attempt
    directories of writers that lost, on tiers that keep attempts apart)."""
    found = []
    for name, manifest in committed.items():
        if manifest.data_dir:
            keep = {MANIFEST_NAME, manifest.data_dir.split("/")[0]}
            found += [f"{name}/{child}" for child in store.listdir(name) if child not in keep]
    return found


def remove_stale_pending(local_root: str) -> None:
    """Remove the pending directories under a local root (no save of this job is in flight)."""
    try:
        names = os.listdir(local_root)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(PENDING_PREFIX):
            log.info("removing stale pending directory %s", name)
            shutil.rmtree(os.path.join(local_root, name), ignore_errors=True)


# ---- registry -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierOptions:
    storage_options: dict[str, Any] = field(default_factory=dict)
    scratch_root: str | None = None  # local directory for attempts of a tier without paths
    concurrency: int = 4  # uploads in flight per rank, where a tier uploads
    # how an object store's uploads are checked: "checksum" (sent with each body, one HEAD)
    # or "readback" (each object downloaded and hashed again)
    upload_verification: str = "checksum"
    # CheckpointConfig.direct_io: whether a local tier writes its files past the page cache
    direct_io: bool | str = "auto"
    # copies of each new shared object a local root keeps (CheckpointConfig.object_copies; the
    # manager passes 1 where a mirror holds them): 2 adds ROOT/objects-copy/<name>
    object_copies: int = 1


TierFactory = Callable[[str, TierOptions], CommitTier]
_KINDS: list[tuple[Callable[[str], bool], TierFactory]] = []


def register_tier(matches: Callable[[str], bool], factory: TierFactory) -> None:
    """Add a tier kind: ``open_tier(url)`` uses the most recently registered match."""
    _KINDS.insert(0, (matches, factory))


def open_tier(url: str, options: TierOptions | None = None) -> CommitTier:
    for matches, factory in _KINDS:
        if matches(url):
            return factory(url, options or TierOptions())
    raise ConfigError(f"no commit tier handles {url!r}")
