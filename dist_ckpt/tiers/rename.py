"""Rank 0's publication of a fully reported generation on a POSIX filesystem.

Order (requirements section 2): DCP ``.metadata`` and every file already fsynced ->
``manifest.json`` written last and fsynced -> directories fsynced -> pending directory
renamed to its final name -> root fsynced -> the published generation validated ->
``latest.json`` replaced atomically.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from .. import faults
from ..errors import GenerationExists, StorageError
from ..format.manifest import (
    DCP_DIR,
    FORMAT_VERSION,
    LATEST_NAME,
    MANIFEST_NAME,
    STATE_DIR,
    FileEntry,
    LatestPointer,
    Manifest,
)
from ..format.signing import SIGNATURE_NAME, sign
from ..format.validate import check_sizes
from ..storage.local import (
    LocalBackend,
    atomic_write,
    file_sha256,
    fsync_dir,
    fsync_file,
    write_durable,
)
from .objectstore import commit_manifest, upload_files

if TYPE_CHECKING:
    from ..save.coordinator import SaveRequest


@dataclass(frozen=True)
class PublishInfo:
    world_size: int
    components: list[str]
    contract: dict[str, str]
    contract_digest: str
    dist_ckpt_version: str


def publish_generation(request: SaveRequest, info: PublishInfo, entries: list[dict],
                       results: list) -> Manifest:
    pending = request.pending
    metadata_entry = _write_dcp_metadata(request, results)
    files = [FileEntry(**e) for e in entries] + [metadata_entry]
    files.sort(key=lambda f: f.path)
    manifest = Manifest(
        format_version=FORMAT_VERSION, generation=request.generation, kind="resume",
        next_update=request.next_update, tokens_seen=request.tokens_seen,
        world_size=info.world_size, components=info.components, contract=info.contract,
        contract_digest=info.contract_digest, torch_version=torch.__version__,
        dist_ckpt_version=info.dist_ckpt_version, created_unix=time.time(),
        save_duration_s=round(time.monotonic() - request.started, 6),
        total_bytes=sum(f.size for f in files), files=files, data_dir=request.data_dir,
    )
    faults.hit("commit.before_manifest", 0)
    if request.remote is not None:
        upload_files(request.remote, pending, request.generation, request.data_dir,
                     [metadata_entry.model_dump()])
        faults.hit("commit.before_rename", 0)
        commit_manifest(request.remote, manifest, key=request.signing_key)
        return manifest
    raw = manifest.to_bytes()
    _rename_into_place(request, raw)
    on_this_node = [f for f in manifest.files
                    if request.local_ranks is None or f.rank in request.local_ranks]
    check_sizes(LocalBackend(request.root), request.generation,
                manifest.model_copy(update={"files": on_this_node}))
    faults.hit("commit.before_latest", 0)
    update_latest(request.root, manifest, raw)
    return manifest


def _rename_into_place(request: SaveRequest, manifest_raw: bytes) -> None:
    pending = request.pending
    if request.signing_key is not None:  # before the manifest: the manifest is the commit point
        write_durable(os.path.join(pending, SIGNATURE_NAME), sign(request.signing_key, manifest_raw))
    write_durable(os.path.join(pending, MANIFEST_NAME), manifest_raw)
    for directory in (os.path.join(pending, DCP_DIR), os.path.join(pending, STATE_DIR), pending):
        if os.path.isdir(directory):
            fsync_dir(directory)
    faults.hit("commit.before_rename", 0)
    final = os.path.join(request.root, request.generation)
    if os.path.exists(final):
        raise GenerationExists(f"{request.generation} already exists under {request.root}")
    os.rename(pending, final)
    fsync_dir(request.root)


def publish_node_copy(request: SaveRequest, manifest_raw: bytes) -> None:
    """Publish this node's part of a generation that rank 0 committed (node-local disks).

    The copy holds the manifest and this node's files only; restore treats a copy that lacks
    listed files as incomplete and reads the generation from the mirror.
    """
    os.makedirs(request.pending, exist_ok=True)
    _rename_into_place(request, manifest_raw)
    manifest = Manifest.model_validate_json(manifest_raw)
    update_latest(request.root, manifest, manifest_raw)


def _write_dcp_metadata(request: SaveRequest, results: list) -> FileEntry:
    dcp_dir = os.path.join(request.pending, DCP_DIR)
    metadata = copy.copy(request.prepared.metadata)
    writer = FileSystemWriter(dcp_dir, sync_files=True)
    writer.finish(metadata, results)
    path = os.path.join(dcp_dir, ".metadata")
    # DCP fsyncs .metadata before flushing its buffer; fsync the finished file ourselves
    fsync_file(path)
    size, digest = file_sha256(path)
    return FileEntry(path=f"{DCP_DIR}/.metadata", size=size, sha256=digest, rank=0)


def update_latest(root: str, manifest: Manifest, raw: bytes) -> None:
    """Point ``latest.json`` at ``manifest``'s generation unless it already points newer."""
    path = os.path.join(root, LATEST_NAME)
    try:
        with open(path, "rb") as handle:
            current: bytes | None = handle.read()
    except FileNotFoundError:
        current = None
    if not LatestPointer.replaces(current, manifest):
        return
    pointer = LatestPointer.for_manifest(manifest, raw)
    try:
        atomic_write(path, pointer.model_dump_json().encode("utf-8"))
    except OSError as exc:
        raise StorageError(f"cannot replace {path}: {exc}") from exc

