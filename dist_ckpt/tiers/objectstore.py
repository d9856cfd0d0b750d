"""The object-store tier: generations on a store without rename (S3 through s3fs).

Protocol for generation ``G`` (docs/architecture.md, "Save"):
1. every rank writes its files to a private local scratch directory, then uploads them below
   ``G/attempt-<attempt id>/`` (unique to this attempt, so two writers of ``G`` never mix
   objects) and verifies each object: with ``upload_verification="checksum"`` (the default)
   each request body carries its CRC32C (or SHA256), which the store checks, and one HEAD
   compares size and stored checksum with what was sent; with ``"readback"`` the size from the
   store and the digest of the bytes read back are compared with the manifest entry;
2. rank 0, after every rank reported, uploads the signature into the attempt's directory,
   creates ``G/manifest.json`` with a conditional create (exactly one writer wins), checks
   the structure and the listed objects' sizes, then replaces ``latest.json``.
As a replay's destination (the mirror), a shared object of an incremental generation goes to
``objects/<name>`` at the store's root, uploaded only when the store lacks it there, and the
replay creates the manifest only once every object it lists is there (``replay/replayer.py``);
readers fetch it from there (``Manifest.where``, ``tiers/verified.py``).
Readers trust only generations whose manifest exists, is named by no rejection marker and
whose objects verify; objects of failed attempts are orphans that only retention removes
(``debris``). A rejected generation is copied aside below ``rejected/`` (``move_aside``:
``dist_ckpt.tiers.rejected_store``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import faults, logs
from ..errors import GenerationExists, StorageError
from ..format.manifest import (
    MANIFEST_NAME,
    REJECTED_MARKER_PREFIX,
    FileEntry,
    Manifest,
    RejectedEntry,
    is_object_path,
    pending_dir_name,
)
from ..format.objects import holds_object
from ..format.signing import SIGNATURE_NAME, sign
from ..format.validate import Problem, check_sizes, check_structure, move_latest
from ..storage import checksum
from ..storage.base import StoreReader, is_remote
from ..storage.objectstore import ObjectStore
from .base import (
    GenerationReader,
    attempt_prefix,
    orphan_attempts,
    register_tier,
    remove_own_files,
    remove_stale_pending,
    stale_uncommitted,
)
from .rejected_store import finish_marked, mark_and_move, put_back
from .verified import VerifiedObjectReader

log = logs.get(__name__)
_READ_BACK_ROOTS: set[str] = set()  # stores that report no checksum: warned once each


def upload_files(store: ObjectStore, local_base: str, prefix: str, entries: list[dict], *,
                 concurrency: int = 4) -> None:
    """Upload and verify this rank's files (all ranks call this for their own entries):
    ``local_base/<path>`` to ``<prefix>/<path>`` (``<path>`` at the store's root when
    ``prefix`` is empty: a shared object).

    Where the store takes transport checksums (``store.sends_checksums``: S3 and the tier's
    ``upload_verification="checksum"``), each body goes up with its checksum and one HEAD
    checks size and checksum; otherwise each object is read back and hashed ("readback")."""

    def one(entry: dict) -> None:
        rel = f"{prefix}/{entry['path']}" if prefix else entry["path"]
        local = os.path.join(local_base, entry["path"])
        try:
            if faults.hit("upload.file", entry["rank"]).get("truncate"):
                with open(local, "rb") as handle:  # an injected short upload
                    store.put_bytes(rel, handle.read()[: entry["size"] // 2])
                sent = None
            elif store.sends_checksums:
                sent = store.put_file_checksummed(local, rel)
            else:
                store.put_file(local, rel)
                sent = None
            verify_upload(store, rel, entry, sent)
        except OSError as exc:  # s3fs's translation of a refused request (BadDigest: EIO)
            raise StorageError(f"upload of {rel} to {store.root} failed: {exc}") from exc

    if not entries:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(entries)))) as pool:
        list(pool.map(one, entries))


def verify_upload(store: ObjectStore, rel: str, entry: dict, sent: str | None) -> None:
    """Size and transport checksum from one HEAD when ``sent`` is the checksum the upload sent;
    else (read-back mode, or a store that reports no checksum) size, then the manifest digest
    of the bytes read back."""
    if sent is not None:
        size, stored = store.head_checksum(rel)
    else:
        size, stored = store.size(rel), None
    if size != entry["size"]:
        raise StorageError(f"uploaded {rel} has {size} bytes, expected {entry['size']}")
    if sent is not None and stored is not None:
        if not checksum.matches(stored, sent):
            raise StorageError(f"uploaded {rel}: the store holds {store.checksum_algorithm} {stored}, "
                               f"the upload sent {sent}")
        return
    if sent is not None and store.root not in _READ_BACK_ROOTS:
        _READ_BACK_ROOTS.add(store.root)
        log.warning("%s reports no %s checksum of uploaded objects (%s): verifying them by reading "
                    "them back", store.root, store.checksum_algorithm, rel)
    listed = FileEntry(**entry)
    if store.digest(rel, listed.algorithm) != listed.digest:
        raise StorageError(f"uploaded {rel} does not match its {listed.algorithm}")


class ObjectStoreAttempt:
    def __init__(self, tier: ObjectStoreTier, generation: str, attempt_id: str,
                 source_dir: str | None) -> None:
        self.tier = tier
        self.generation = generation
        self.attempt_id = attempt_id
        self.data_dir = attempt_prefix(attempt_id)
        self.replay = source_dir is not None
        self.shared = tier.shared
        self.direct_io = tier.direct_io
        self.local_dir = source_dir or os.path.join(tier.local_root, pending_dir_name(generation, attempt_id))

    def put_files(self, entries: list[dict]) -> None:
        """Every rank, its own entries: uploaded below ``G/attempt-<id>/``. In a replay a shared
        object (``objects/<name>``, in the source root's ``objects/``) goes to ``objects/<name>``
        at the store's root, where every generation that lists it reads it, and only when the
        store lacks it there or holds it with another size: each object is uploaded once, whatever
        number of generations reference it. (A save into this tier writes no objects: it keeps
        one copy per generation, ``shares_objects`` is False.)"""
        own = [e for e in entries if not is_object_path(e["path"])]
        shared = [e for e in entries if is_object_path(e["path"])]
        if shared and not self.replay:
            raise StorageError(f"{self.generation}: a save into {self.tier.url} lists shared objects, "
                               "which only a replay brings (incremental saves are off here)")
        upload_files(self.tier.store, self.local_dir, f"{self.generation}/{self.data_dir}", own,
                     concurrency=self.tier.concurrency)
        absent = [e for e in shared if not holds_object(self.tier.store, FileEntry(**e))]
        upload_files(self.tier.store, os.path.dirname(os.path.normpath(self.local_dir)), "", absent,
                     concurrency=self.tier.concurrency)

    def publish(self, manifest: Manifest, signing_key: bytes | None) -> bytes:
        store = self.tier.store
        manifest = manifest.model_copy(update={"data_dir": self.data_dir})
        raw = manifest.to_bytes()
        faults.hit("commit.before_rename", 0)
        if signing_key is not None:  # inside this attempt: a losing writer's cannot replace it
            store.put_bytes(f"{self.generation}/{manifest.location(SIGNATURE_NAME)}", sign(signing_key, raw))
        try:
            self._create_manifest(raw)
        except FileExistsError as exc:
            raise GenerationExists(f"{self.generation} already exists under {store.root} "
                                   "(another writer committed it)") from exc
        faults.hit("commit.after_rename", 0)
        check_structure(store, self.generation, key=signing_key)
        # the ranks verified their own uploads; this asks the store once more, in parallel
        check_sizes(store, self.generation, manifest, concurrency=max(16, self.tier.concurrency))
        move_latest(store, manifest, raw)
        return raw

    def _create_manifest(self, raw: bytes) -> None:
        """The conditional create; a rejected manifest still in the way (its move aside was
        cut short) is moved aside first, and the create tried once more."""
        rel = f"{self.generation}/{MANIFEST_NAME}"
        try:
            self.tier.store.create_exclusive(rel, raw)
        except FileExistsError:
            if not finish_marked(self.tier.store, self.generation):
                raise
            self.tier.store.create_exclusive(rel, raw)

    def publish_copy(self, manifest_raw: bytes) -> None:
        pass  # one copy serves every rank (shared)

    def release(self, entries: list[dict], committed: bool) -> None:
        if not self.replay:  # local scratch of an upload: never needed again
            remove_own_files(self.local_dir, entries)

    def abandon(self) -> None:
        if not self.replay:
            shutil.rmtree(self.local_dir, ignore_errors=True)
        # best effort: retention removes whatever a crashed uploader leaves behind
        try:
            self.tier.store.remove_tree(f"{self.generation}/{self.data_dir}")
        except Exception:  # noqa: BLE001 - cleanup must not mask the commit failure
            traceback.print_exc()


class ObjectStoreTier:
    """Generations below an fsspec URL; one copy serves every rank."""

    shared = True
    shares_objects = False  # a save into it keeps one copy per generation (replays: see above)
    direct_io = False  # the upload reads each file right after it is written
    kind = "object store"
    leaves_debris = True
    keeps_rejected = True
    reshards = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 scratch_root: str | None = None, concurrency: int = 4,
                 upload_verification: str = "checksum") -> None:
        self.store = ObjectStore(url, storage_options, checksums=upload_verification == "checksum")
        self.url = self.store.root
        self.local_root = scratch_root or tempfile.gettempdir()
        self.local_ranks: frozenset[int] | None = None  # one copy: every rank's files
        self.concurrency = concurrency

    def begin(self, generation: str, attempt_id: str, *,
              source_dir: str | None = None) -> ObjectStoreAttempt:
        return ObjectStoreAttempt(self, generation, attempt_id, source_dir)

    def open_reader(self, generation: str, manifest: Manifest,
                    scratch_parent: str | None = None) -> GenerationReader:
        # each object is downloaded once into a private copy, hashed as it streams
        return VerifiedObjectReader(self.store, generation, manifest, scratch_parent)

    def remove_leftover_attempts(self) -> None:
        remove_stale_pending(self.local_root)  # remote orphans are retention's (debris)

    def debris(self, committed: dict[str, Manifest], uncommitted: list[str]) -> list[str]:
        """Generations without a manifest older than the newest committed one (newer ones may
        be uploads in flight), and attempt directories no committed manifest references. A
        generation with a rejection marker is kept: its move aside was cut short, and
        ``dist-ckpt quarantine`` (or a save of its update) finishes it."""
        stale = [name for name in stale_uncommitted(committed, uncommitted)
                 if not any(child.startswith(REJECTED_MARKER_PREFIX)
                            for child in self.store.listdir(name))]
        return stale + orphan_attempts(self.store, committed)

    def move_aside(self, problem: Problem) -> str | None:
        """Copied below ``rejected/`` in restartable steps (``dist_ckpt.tiers.rejected_store``)."""
        return mark_and_move(self.store, problem)

    def put_back(self, entry: RejectedEntry, check: Callable[[StoreReader], Any]) -> str:
        """Copied back from ``rejected/``, manifest last (``dist_ckpt.tiers.rejected_store``)."""
        return put_back(self.store, entry, check)


register_tier(is_remote, lambda url, options: ObjectStoreTier(
    url, options.storage_options, options.scratch_root, options.concurrency, options.upload_verification))
