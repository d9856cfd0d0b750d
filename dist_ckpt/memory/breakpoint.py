"""Persist at breakpoint: the launcher's last look at a node's memory before removing it.

When the node's launcher is about to exit (it gave up, was stopped, or hit a permanent
failure) its memory directory may hold a committed generation newer than anything on the
root: every update since the last persisted one, about to be lost with the node.
:func:`persist_memory` copies that generation to the root first:

1. the newest generation under the root that has a manifest (committed, or a node's copy) is
   the floor; memory generations with a manifest above it are tried newest first;
2. the manifest parses and lists what it must (signature checked with the environment's key);
   every listed file this node must hold is there with its size: all of them on one node,
   the files present on a node of several (its own ranks' and the common ones);
3. each file is copied into a pending directory under the root and hashed on the way
   (``copy_verified``): a byte changed in memory fails the copy, nothing is published, and
   the reason is returned (the next older candidate is tried). A shared object of an
   incremental generation (``objects/<name>``, in memory's ``objects/``) goes to
   ``pending/objects/<name>`` only when the root's ``objects/`` lacks it (or holds it with
   another size): the root keeps one copy of each object;
4. the usual publish: signature, manifest last, fsyncs, the pending objects moved into the
   root's ``objects/`` (``install_objects``: referenced bytes are durable before the rename
   that makes the manifest visible), one rename to the generation's name, root fsync, sizes
   checked in place, ``latest.json`` moved (``move_latest``).

On several nodes each node's launcher brings its node's part. On a shared root the parts meet
in one pending directory named by the manifest's digest; the launcher that completes it
publishes (under that directory's lock). A root whose newest generation is a node's copy (it
lacks other nodes' files: node-local disks) gets this node's copy, as the rename tier's
``publish_copy`` does. A replay's node copy also holds the common files, which rank 0 offers
through the c10d store (``replay/common_files.py``); the launcher has no such channel, so a
copy persisted here holds them only where this node's memory does (rank 0's node always).

Nothing here imports torch: the launcher calls it through ``dist_ckpt.launcher_api``.

Call order: the node's launcher, main thread, once, after its last start ended and before it
removes the memory directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass

from ..errors import DistCkptError, GenerationExists, ValidationError
from ..format.copy import copy_verified, listed_source
from ..format.manifest import MANIFEST_NAME, Manifest, is_object_path, parse_generation, pending_dir_name
from ..format.objects import holds_object, install_objects, keeps_copies, write_copies
from ..format.signing import SIGNATURE_NAME, key_from_env
from ..format.validate import check_sizes, check_structure, list_generations, move_latest
from ..storage.local import LocalStore, fsync_dir, makedirs_durable, open_regular, write_durable

LOCK_NAME = ".breakpoint.lock"


@dataclass
class Persisted:
    """What the launcher says in its last line."""

    generation: str | None  # published on the root from memory; None: nothing was
    message: str
    complete: bool = True  # False: this node's part waits for the other nodes' parts


def persist_memory(memory_root: str, root: str, *, nodes: int = 1,
                   key: bytes | None = None) -> Persisted | None:
    """Persist the newest intact memory generation newer than the root's newest; None when
    memory holds none newer (nothing to say)."""
    key = key if key is not None else key_from_env()
    if not os.path.isdir(memory_root):
        return None
    memory, disk = LocalStore(memory_root), LocalStore(root)
    floor = _newest_with_manifest(disk)
    candidates = [g for g in list_generations(memory)
                  if (parse_generation(g) or 0) > floor and memory.exists(f"{g}/{MANIFEST_NAME}")]
    refused: list[str] = []
    for generation in candidates:
        try:
            manifest = check_structure(memory, generation, key=key)
            raw = memory.read_bytes(f"{generation}/{MANIFEST_NAME}")
            files = _node_files(memory, generation, manifest, nodes)
            done = _publish(memory_root, root, generation, manifest, raw, files)
        except (DistCkptError, OSError) as exc:
            refused.append(f"{generation} not persisted: {exc}")
            continue
        return Persisted(generation if done.complete else None,
                         "; ".join([*refused, done.message]), done.complete)
    if refused:
        return Persisted(None, "; ".join(refused))
    return None


def _newest_with_manifest(store: LocalStore) -> int:
    for name in list_generations(store):
        if store.exists(f"{name}/{MANIFEST_NAME}"):
            return parse_generation(name) or 0
    return -1


def _node_files(memory: LocalStore, generation: str, manifest: Manifest, nodes: int) -> list[str]:
    """The listed files this node holds and must copy: every one on a single node."""
    if nodes <= 1:
        check_sizes(memory, generation, manifest)
        return [f.path for f in manifest.files]
    present = [f for f in manifest.files if memory.exists(manifest.where(f.path))]
    if not present:
        raise ValidationError(f"{generation}: this node holds none of its files", generation=generation)
    check_sizes(memory, generation, manifest.model_copy(update={"files": present}))
    return [f.path for f in present]


@dataclass
class _Done:
    complete: bool
    message: str


def _publish(memory_root: str, root: str, generation: str, manifest: Manifest, raw: bytes,
             files: list[str]) -> _Done:
    makedirs_durable(root)  # a root this creates must outlive a power cut with what it holds
    disk = LocalStore(root)
    whole = len(files) == len(manifest.files)
    node_copy = not whole and _node_local(disk)
    if whole or node_copy:
        pending = os.path.join(root, pending_dir_name(generation, uuid.uuid4().hex[:8]))
        try:
            _copy(memory_root, pending, generation, manifest, files)
            _commit(memory_root, root, pending, generation, manifest, raw, check=whole)
        finally:
            shutil.rmtree(pending, ignore_errors=True)  # gone after a commit: its rename
        what = "" if whole else f"this node's copy ({len(files)} of {len(manifest.files)} files) of "
        return _Done(True, f"persisted {what}{generation} from memory to {root}")
    # a shared root: the nodes' parts meet in one pending directory named by the manifest
    pending = os.path.join(root, pending_dir_name(generation, hashlib.sha256(raw).hexdigest()[:8]))
    os.makedirs(pending, exist_ok=True)
    fd = os.open(os.path.join(pending, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _copy(memory_root, pending, generation, manifest, files, keep_present=True)
        there = sum(os.path.exists(os.path.join(pending, f.path))
                    or (is_object_path(f.path) and holds_object(disk, f))
                    for f in manifest.files)
        if there < len(manifest.files):
            return _Done(False, f"persisted this node's part of {generation} from memory to "
                                f"{pending} ({there} of {len(manifest.files)} files): published "
                                "when every node's part is there")
        os.unlink(os.path.join(pending, LOCK_NAME))
        _commit(memory_root, root, pending, generation, manifest, raw, check=True)
        return _Done(True, f"persisted {generation} from memory to {root} (this node's part "
                           "completed it)")
    finally:
        os.close(fd)


def _node_local(disk: LocalStore) -> bool:
    """Whether the root's newest generation is a node's copy (lacks listed files)."""
    for name in list_generations(disk):
        if disk.exists(f"{name}/{MANIFEST_NAME}"):
            try:
                manifest = Manifest.from_bytes(disk.read_bytes(f"{name}/{MANIFEST_NAME}"), generation=name)
            except (ValidationError, OSError):
                return False
            return not all(disk.exists(manifest.where(f.path)) for f in manifest.files)
    return False


def _copy(memory_root: str, pending: str, generation: str, manifest: Manifest, files: list[str],
          *, keep_present: bool = False) -> None:
    """Each of ``files`` from memory into ``pending``, verified; a shared object the root
    (``pending``'s parent) holds already is not copied again. A new one gets its second copy
    where the root keeps them (``keeps_copies``: this process does not see the job's
    ``object_copies``, the root's ``objects-copy/`` says it)."""
    disk = LocalStore(os.path.dirname(os.path.normpath(pending)))
    copies = keeps_copies(disk.root)
    for path in files:
        entry = manifest.file(path)
        assert entry is not None  # a listed file (_node_files)
        shared = is_object_path(path)
        if shared and holds_object(disk, entry):
            continue  # the root's copy serves this generation too
        rel = path if shared else manifest.location(path)
        target = os.path.join(pending, rel)
        if keep_present and os.path.exists(target) and os.path.getsize(target) == entry.size:
            continue  # another node brought it, verified
        try:
            copy_verified(listed_source(os.path.join(memory_root, generation), rel), target, entry,
                          generation)
            if shared and copies:
                write_copies(pending, [entry], generation)
        except ValidationError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            raise


def _commit(memory_root: str, root: str, pending: str, generation: str, manifest: Manifest,
            raw: bytes, *, check: bool) -> None:
    """Signature (the memory copy's: it signs these very manifest bytes), manifest last,
    fsyncs, shared objects installed, rename, root fsync, sizes, latest pointer."""
    signature = os.path.join(memory_root, generation, manifest.location(SIGNATURE_NAME))
    if os.path.exists(signature):
        with open_regular(signature) as handle:
            write_durable(os.path.join(pending, manifest.location(SIGNATURE_NAME)), handle.read())
    write_durable(os.path.join(pending, MANIFEST_NAME), raw)
    for parent, _dirs, _files in os.walk(pending, topdown=False):
        fsync_dir(parent)
    final = os.path.join(root, generation)
    if os.path.exists(final):
        raise GenerationExists(f"{generation} already exists under {root}")
    # the shared objects before the rename that makes the manifest referencing them visible
    install_objects(pending, root)
    os.rename(pending, final)
    fsync_dir(root)
    disk = LocalStore(root)
    if check:
        check_sizes(disk, generation, manifest)
    move_latest(disk, manifest, raw)

