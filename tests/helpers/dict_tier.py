"""A test-only commit tier that keeps generations in a Python dict (``dicttier://NAME``).

It exists to prove that adding a tier is one module implementing ``CommitTier`` plus
``register_tier``: nothing else in dist_ckpt learns of it. Semantics follow a store without
rename: each attempt's files live below ``G/attempt-<id>/``, the manifest is created last
with an exclusive create, and reads are verified copies. One dict per URL, process-wide.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
from typing import IO

from dist_ckpt.digests import digest_bytes
from dist_ckpt.errors import GenerationExists, StorageError, UnsafeFileError
from dist_ckpt.format.manifest import MANIFEST_NAME, Manifest, pending_dir_name
from dist_ckpt.format.signing import SIGNATURE_NAME, sign
from dist_ckpt.format.validate import Problem, check_sizes, check_structure, move_latest
from dist_ckpt.tiers import register_tier
from dist_ckpt.tiers.base import (
    GenerationReader,
    TierOptions,
    attempt_prefix,
    orphan_attempts,
    remove_own_files,
    remove_stale_pending,
    stale_uncommitted,
)
from dist_ckpt.tiers.verified import VerifiedObjectReader

SCHEME = "dicttier://"
_STORES: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class DictStore:
    """A ``Store`` over one dict: names are keys, directories are key prefixes."""

    def __init__(self, url: str) -> None:
        self.root = url.rstrip("/")
        with _LOCK:
            self.objects = _STORES.setdefault(self.root, {})

    def url(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _below(self, rel: str) -> list[str]:
        prefix = f"{rel.rstrip('/')}/" if rel else ""
        return [k for k in list(self.objects) if k.startswith(prefix)]

    def exists(self, rel: str) -> bool:
        return not rel or rel in self.objects or bool(self._below(rel))

    def listdir(self, rel: str) -> list[str]:
        cut = len(rel.rstrip("/")) + 1 if rel else 0
        return sorted({k[cut:].split("/", 1)[0] for k in self._below(rel)})

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.objects[rel]
        except KeyError:
            raise FileNotFoundError(self.url(rel)) from None

    def open_read(self, rel: str) -> IO[bytes]:
        return io.BytesIO(self.read_bytes(rel))

    def size(self, rel: str) -> int:
        return len(self.read_bytes(rel))

    def checked_size(self, rel: str, *, limit: int | None = None,
                     sound_dirs: set[str] | None = None) -> int:
        size = self.size(rel)
        if limit is not None and size > limit:
            raise UnsafeFileError(f"{size} bytes, over the {limit} byte bound")
        return size

    def digest(self, rel: str, algorithm: str) -> str:
        return digest_bytes(self.read_bytes(rel), algorithm)

    def tree_size(self, rel: str) -> int:
        return sum(len(self.objects[k]) for k in self._below(rel))

    def local_path(self, rel: str) -> None:
        return None

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.objects[rel] = bytes(data)

    def put_file(self, local_path: str, rel: str) -> None:
        with open(local_path, "rb") as handle:
            self.objects[rel] = handle.read()

    def create_exclusive(self, rel: str, data: bytes) -> None:
        with _LOCK:
            if rel in self.objects:
                raise FileExistsError(self.url(rel))
            self.objects[rel] = bytes(data)

    def remove_tree(self, rel: str) -> None:
        for key in [rel] + self._below(rel):
            self.objects.pop(key, None)

    def abort_uploads(self, rel: str) -> int:
        return 0


class DictAttempt:
    def __init__(self, tier: DictTier, generation: str, attempt_id: str, source_dir: str | None) -> None:
        self.tier = tier
        self.generation = generation
        self.attempt_id = attempt_id
        self.data_dir = attempt_prefix(attempt_id)
        self.shared = tier.shared
        self.direct_io = tier.direct_io
        self.replay = source_dir is not None
        self.local_dir = source_dir or os.path.join(tier.local_root, pending_dir_name(generation, attempt_id))

    def put_files(self, entries: list[dict]) -> None:
        for entry in entries:
            self.tier.store.put_file(os.path.join(self.local_dir, entry["path"]),
                                     f"{self.generation}/{self.data_dir}/{entry['path']}")

    def publish(self, manifest: Manifest, signing_key: bytes | None) -> bytes:
        store = self.tier.store
        manifest = manifest.model_copy(update={"data_dir": self.data_dir})
        raw = manifest.to_bytes()
        if signing_key is not None:
            store.put_bytes(f"{self.generation}/{manifest.location(SIGNATURE_NAME)}", sign(signing_key, raw))
        try:
            store.create_exclusive(f"{self.generation}/{MANIFEST_NAME}", raw)
        except FileExistsError as exc:
            raise GenerationExists(f"{self.generation} already exists under {store.root}") from exc
        check_structure(store, self.generation, key=signing_key)
        check_sizes(store, self.generation, manifest)
        move_latest(store, manifest, raw)
        return raw

    def publish_copy(self, manifest_raw: bytes) -> None:
        pass

    def release(self, entries: list[dict], committed: bool) -> None:
        if not self.replay:
            remove_own_files(self.local_dir, entries)

    def abandon(self) -> None:
        if not self.replay:
            import shutil

            shutil.rmtree(self.local_dir, ignore_errors=True)
        self.tier.store.remove_tree(f"{self.generation}/{self.data_dir}")


class DictTier:
    shared = True
    shares_objects = False
    direct_io = False
    kind = "dict (test)"
    leaves_debris = True
    keeps_rejected = False
    reshards = True

    def __init__(self, url: str, scratch_root: str | None = None) -> None:
        self.store = DictStore(url)
        self.url = self.store.root
        self.local_root = scratch_root or tempfile.gettempdir()
        self.local_ranks: frozenset[int] | None = None

    def begin(self, generation: str, attempt_id: str, *, source_dir: str | None = None) -> DictAttempt:
        return DictAttempt(self, generation, attempt_id, source_dir)

    def open_reader(self, generation: str, manifest: Manifest,
                    scratch_parent: str | None = None) -> GenerationReader:
        return VerifiedObjectReader(self.store, generation, manifest, scratch_parent)

    def remove_leftover_attempts(self) -> None:
        remove_stale_pending(self.local_root)

    def debris(self, committed: dict[str, Manifest], uncommitted: list[str]) -> list[str]:
        return stale_uncommitted(committed, uncommitted) + orphan_attempts(self.store, committed)

    def move_aside(self, problem: Problem) -> str | None:
        return None


def _open(url: str, options: TierOptions) -> DictTier:
    if options.scratch_root is not None:
        os.makedirs(options.scratch_root, exist_ok=True)
    return DictTier(url, options.scratch_root)


register_tier(lambda url: url.startswith(SCHEME), _open)
__all__ = ["SCHEME", "DictStore", "DictTier", "StorageError"]
