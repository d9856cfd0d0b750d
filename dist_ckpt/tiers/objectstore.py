"""Object-store side of a generation: verified uploads, manifest-last conditional commit.

Protocol for generation ``G`` on a store (no rename exists):
1. every rank uploads its own files below ``G/<data_dir>/`` (a directory unique to this save
   attempt, so two writers of ``G`` never mix objects) and verifies each object: size from the
   store, sha256 of the bytes read back, both against what the client computed locally;
2. rank 0, after every rank reported, creates ``G/manifest.json`` with a conditional create
   (exactly one writer wins), re-checks the listed objects' sizes, then replaces ``latest.json``.
Readers trust only generations whose manifest exists and whose objects verify; objects of
failed attempts are orphans that only the pruner removes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .. import faults
from ..errors import StorageError
from ..format.manifest import LATEST_NAME, MANIFEST_NAME, LatestPointer, Manifest
from ..format.signing import SIGNATURE_NAME, sign
from ..format.validate import check_sizes, check_structure
from ..storage.objectstore import ObjectStoreBackend


def upload_files(backend: ObjectStoreBackend, local_base: str, generation: str, data_dir: str,
                 entries: list[dict], *, verify_digest: bool = True, concurrency: int = 4) -> None:
    """Upload and verify this rank's files (all ranks call this for their own entries)."""

    def one(entry: dict) -> None:
        rel = f"{generation}/{data_dir}/{entry['path']}" if data_dir else f"{generation}/{entry['path']}"
        local = os.path.join(local_base, entry["path"])
        if faults.hit("upload.file", entry["rank"]).get("truncate"):
            with open(local, "rb") as handle:  # an injected short upload
                backend.put_bytes(rel, handle.read()[: entry["size"] // 2])
        else:
            backend.put_file(local, rel)
        size = backend.size(rel)
        if size != entry["size"]:
            raise StorageError(f"uploaded {rel} has {size} bytes, expected {entry['size']}")
        if verify_digest and backend.sha256(rel) != entry["sha256"]:
            raise StorageError(f"uploaded {rel} does not match its sha256")

    if not entries:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(entries)))) as pool:
        list(pool.map(one, entries))


def commit_manifest(backend: ObjectStoreBackend, manifest: Manifest, *, key: bytes | None = None) -> bytes:
    """Rank 0: signature (inside this attempt's data directory, so a losing writer's cannot
    replace it), conditional create of the manifest, validation, then the latest pointer."""
    raw = manifest.to_bytes()
    if key is not None:
        backend.put_bytes(f"{manifest.generation}/{manifest.location(SIGNATURE_NAME)}", sign(key, raw))
    backend.create_exclusive(f"{manifest.generation}/{MANIFEST_NAME}", raw)
    check_structure(backend, manifest.generation, key=key)
    check_sizes(backend, manifest.generation, manifest)
    update_remote_latest(backend, manifest, raw)
    return raw


def update_remote_latest(backend: ObjectStoreBackend, manifest: Manifest, raw: bytes) -> None:
    try:
        current: bytes | None = backend.read_bytes(LATEST_NAME)
    except FileNotFoundError:
        current = None
    if not LatestPointer.replaces(current, manifest):
        return
    backend.put_bytes(LATEST_NAME, LatestPointer.for_manifest(manifest, raw).model_dump_json().encode())

