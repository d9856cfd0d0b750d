"""The rename tier: generations in a POSIX directory, committed by one rename.

Publication order (rank 0; docs/architecture.md, "Save"): DCP ``.metadata`` and every file
already fsynced -> signature, then ``manifest.json`` written last and fsynced -> directories
fsynced -> the pending directory renamed to the generation's name -> root fsynced -> the
published generation's sizes checked -> ``latest.json`` replaced atomically.

On node-local disks every filesystem group holds its own copy: the leader of a group without
rank 0 publishes its node's files with the manifest rank 0 committed (``publish_copy``).
"""

from __future__ import annotations

import functools
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from .. import faults, logs
from ..errors import GenerationExists
from ..format.copy import copy_verified, listed_source
from ..format.manifest import (
    DCP_DIR,
    MANIFEST_NAME,
    STATE_DIR,
    FileEntry,
    Manifest,
    RejectedEntry,
    check_generation_name,
    check_relative_path,
    is_object_path,
    parse_generation,
    pending_dir_name,
)
from ..format.objects import holds_object, install_objects, write_copies
from ..format.signing import SIGNATURE_NAME, sign
from ..format.validate import Problem, check_sizes, move_latest
from ..storage.base import StoreReader, is_remote
from ..storage.directio import durable_file, resolve_direct_io
from ..storage.local import LocalStore, fsync_dir, write_durable
from .base import (
    GenerationReader,
    LocalFilesReader,
    register_tier,
    remove_own_files,
    remove_stale_pending,
    stale_uncommitted,
)
from .rejected import move_aside, put_back, replace_file

log = logs.get(__name__)


class RenameAttempt:
    def __init__(self, tier: RenameTier, generation: str, attempt_id: str,
                 source_dir: str | None) -> None:
        self.tier = tier
        self.generation = generation
        self.attempt_id = attempt_id
        self.data_dir = ""
        self.source_dir = source_dir
        self.replay = source_dir is not None
        self.shared = tier.shared
        self.direct_io = tier.direct_io
        self.object_copies = tier.object_copies  # a save's writer reads it (save/coordinator.py)
        # a replay (the memory tier's persistence) copies into its own pending directory: the
        # source generation stays where it is, committed
        self.local_dir = os.path.join(tier.root, pending_dir_name(generation, attempt_id))

    def put_files(self, entries: list[dict]) -> None:
        """A replay (every rank, its own entries): each file copied from the source tier into
        this attempt's pending directory, hashed on the way. A shared object (``objects/<name>``,
        in the source tier's ``objects/``) is copied to ``pending/objects/<name>`` only when
        this root's ``objects/`` lacks it or holds it with another size; the publish installs
        it (``install_objects``, before the rename), with its second copy where this root keeps
        one (``object_copies``). One this root holds is not copied again: the replay's publish
        checks that it is still there (``Replayer._commit``)."""
        if not self.replay:
            return  # written in place and fsynced by the writer: the rename publishes them
        assert self.source_dir is not None
        sink = functools.partial(durable_file, direct=self.direct_io)
        copied: list[FileEntry] = []
        for entry in (FileEntry(**fields) for fields in entries):
            if is_object_path(entry.path) and holds_object(self.tier.store, entry):
                continue
            copy_verified(listed_source(self.source_dir, entry.path),
                          os.path.join(self.local_dir, entry.path), entry, self.generation,
                          open_target=sink)
            copied.append(entry)
        if self.object_copies > 1:  # the memory it came from is not a lasting second copy
            write_copies(self.local_dir, [e for e in copied if is_object_path(e.path)],
                         self.generation, open_target=sink)

    def publish(self, manifest: Manifest, signing_key: bytes | None) -> bytes:
        raw = manifest.to_bytes()
        self._rename_into_place(raw, signing_key)
        faults.hit("commit.after_rename", 0)
        local_ranks = self.tier.local_ranks
        on_this_node = [f for f in manifest.files if local_ranks is None or f.rank in local_ranks]
        check_sizes(self.tier.store, self.generation,
                    manifest.model_copy(update={"files": on_this_node}))
        faults.hit("commit.before_latest", 0)
        move_latest(self.tier.store, manifest, raw)
        return raw

    def publish_copy(self, manifest_raw: bytes) -> None:
        """The copy holds the manifest and this node's files only; restore treats a copy that
        lacks listed files as incomplete and reads the generation from the mirror."""
        os.makedirs(self.local_dir, exist_ok=True)
        self._rename_into_place(manifest_raw, None)
        manifest = Manifest.model_validate_json(manifest_raw)
        move_latest(self.tier.store, manifest, manifest_raw)

    def _rename_into_place(self, manifest_raw: bytes, signing_key: bytes | None) -> None:
        pending = self.local_dir
        if signing_key is not None:  # before the manifest: the manifest is the commit point
            write_durable(os.path.join(pending, SIGNATURE_NAME), sign(signing_key, manifest_raw))
        write_durable(os.path.join(pending, MANIFEST_NAME), manifest_raw)
        for directory in (os.path.join(pending, DCP_DIR), os.path.join(pending, STATE_DIR), pending):
            if os.path.isdir(directory):
                fsync_dir(directory)
        # the shared objects before the rename that makes the manifest referencing them visible
        install_objects(pending, self.tier.root)
        faults.hit("commit.before_rename", 0)
        final = os.path.join(self.tier.root, self.generation)
        if os.path.exists(final):
            raise GenerationExists(f"{self.generation} already exists under {self.tier.root}")
        os.rename(pending, final)
        fsync_dir(self.tier.root)

    def release(self, entries: list[dict], committed: bool) -> None:
        if not committed and not self.replay:
            remove_own_files(self.local_dir, entries)

    def abandon(self) -> None:
        shutil.rmtree(self.local_dir, ignore_errors=True)  # a replay's copy, never its source


class RenameTier:
    """Generations as directories under ``root``; ``shared`` is False: on node-local disks
    each filesystem group publishes its own copy."""

    shared = False
    shares_objects = True  # incremental generations: objects/ below the root (format/objects.py)
    kind = "local"
    leaves_debris = False
    keeps_rejected = True
    reshards = True

    def __init__(self, root: str, local_ranks: frozenset[int] | None = None, *,
                 direct_io: bool | str = "auto", object_copies: int = 1) -> None:
        self.store = LocalStore(root)
        self.root = self.store.root
        self.url = self.root
        self.local_root = self.root
        self.local_ranks = local_ranks
        self.direct_io = resolve_direct_io(direct_io, self.root)
        # 2: each new shared object also gets ROOT/objects-copy/<name> (format/objects.py);
        # the manager asks for it where no mirror holds the objects (TierOptions)
        self.object_copies = object_copies

    def begin(self, generation: str, attempt_id: str, *,
              source_dir: str | None = None) -> RenameAttempt:
        return RenameAttempt(self, generation, attempt_id, source_dir)

    def open_reader(self, generation: str, manifest: Manifest,
                    scratch_parent: str | None = None) -> GenerationReader:
        # a local root is trusted-local data: DCP reads the files themselves
        return LocalFilesReader(self.store, generation, manifest,
                                os.path.join(self.root, generation, manifest.location(DCP_DIR)))

    def remove_leftover_attempts(self) -> None:
        remove_stale_pending(self.root)

    def debris(self, committed: dict[str, Manifest], uncommitted: list[str]) -> list[str]:
        """A rename leaves no partial generation, but a prune cut short leaves one without its
        manifest (removed first): older than the newest committed, the next prune finishes it."""
        return stale_uncommitted(committed, uncommitted)

    def move_aside(self, problem: Problem) -> str | None:
        if parse_generation(problem.generation) is None:
            return None
        return move_aside(self.root, problem)

    def put_back(self, entry: RejectedEntry, check: Callable[[StoreReader], Any]) -> str:
        """One rename back from ``ROOT/rejected/`` (``tiers/rejected.py``)."""
        return put_back(self.store, entry, check)

    def repair_dir(self, generation: str) -> str:
        path = os.path.join(self.root, pending_dir_name(generation, f"repair-{uuid.uuid4().hex[:8]}"))
        os.makedirs(path)
        return path

    def replace_file(self, generation: str, manifest: Manifest, path: str, fresh: str | None,
                     reason: str) -> str | None:
        """Install ``fresh`` as ``path`` of ``generation`` (``dist_ckpt.restore.repair``): a
        shared object at ``ROOT/objects/<name>``, where every generation that references it
        reads it (one repair serves them all), any other file below the generation. The
        damaged copy goes to ``ROOT/rejected/<G>-files-<time>-<id>/<path>``. ``fresh`` None
        (a shared object no other tier holds): the damaged copy is only moved aside."""
        check_generation_name(generation)
        rel = check_relative_path(path)
        return replace_file(self.root, generation, rel if is_object_path(rel) else manifest.location(rel),
                            fresh, reason)


register_tier(lambda url: not is_remote(url),
              lambda url, options: RenameTier(url.removeprefix("file://"), direct_io=options.direct_io,
                                              object_copies=options.object_copies))
