"""Hand-made committed generations (a manifest and the files it lists, no torch job): for tests
of what reads or copies a generation without loading it."""

from __future__ import annotations

import hashlib
import os

from dist_ckpt import __version__
from dist_ckpt.format.manifest import (
    FORMAT_VERSION,
    GLOBAL_STATE_FILE,
    MANIFEST_NAME,
    METADATA_FILE,
    FileEntry,
    Manifest,
    generation_name,
    rank_state_file,
)
from dist_ckpt.format.validate import move_latest
from dist_ckpt.storage.local import LocalStore


def contents(update: int, world_size: int) -> dict[str, tuple[bytes, int]]:
    """Each listed file's bytes and writing rank: the common files are rank 0's."""
    files = {METADATA_FILE: (b"m" * 10, 0), GLOBAL_STATE_FILE: (b'{"u": %d}' % update, 0)}
    for rank in range(world_size):
        files[rank_state_file(rank)] = (b"{}", rank)
        files[f"dcp/__{rank}_0.distcp"] = (bytes([update % 256, rank]) * 500, rank)
    return files


def write_generation(root: str, update: int, *, world_size: int = 1,
                     ranks: set[int] | None = None, latest: bool = True) -> Manifest:
    """Generation ``update`` under ``root``, committed (manifest last); ``ranks``: write only
    these ranks' files (a node's copy on several nodes), the manifest lists every file."""
    name = generation_name(update)
    entries = []
    for rel, (data, rank) in contents(update, world_size).items():
        entries.append(FileEntry(path=rel, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                 rank=rank))
        if ranks is not None and rank not in ranks:
            continue
        path = os.path.join(root, name, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(data)
    manifest = Manifest(
        format_version=FORMAT_VERSION, generation=name, next_update=update, tokens_seen=update,
        world_size=world_size, components=[], contract={}, contract_digest="", torch_version="0",
        dist_ckpt_version=__version__, created_unix=1.7e9 + update, save_duration_s=1.0,
        total_bytes=sum(e.size for e in entries), files=entries)
    raw = manifest.to_bytes()
    with open(os.path.join(root, name, MANIFEST_NAME), "wb") as handle:
        handle.write(raw)
    if latest:
        move_latest(LocalStore(root), manifest, raw)
    return manifest


def flip_byte(root: str, generation: str, rel: str) -> None:
    path = os.path.join(root, generation, rel)
    with open(path, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))
