"""The restore-time exchange of the memory tier, routed: which node sends which file to which.

Every node leader contributes its inventory (``inventory``: its newest in-memory generations
and replicas, with the files each holds), each copy named by its manifest's sha256, not its
bytes: a manifest is O(W), and rank 0 reads each one only once (its own copy, or from one
holder: ``wanted_manifests``). Rank 0 chooses, from all of them, the newest generation every
node can complete (``route_exchange``), and the transfers that complete it:

- into a node's memory copy: the files of its own ranks and the common files it lacks
  (``.metadata``, the global train state; the manifest signature on rank 0's node);
- into a node's fetched directory (read by its load only, then deleted): other nodes' shard
  files that hold an item stored once for every rank (DCP writes a replicated tensor, such as
  a step count or a DDP parameter, into one rank's file). The inventory names them from the
  generation's ``.metadata``, read only once its digest matched the manifest.

Each transfer names one source holding the file under the same manifest (bytes identical or
refused at arrival), spread over the holders. Pure functions: ``memory/exchange.py`` runs the routes.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ..errors import DistCkptError
from ..format.manifest import COMMON_FILES, DCP_DIR, MANIFEST_NAME, METADATA_FILE, Manifest, parse_generation
from ..format.signing import SIGNATURE_NAME
from ..format.validate import check_entry
from ..storage.local import file_digest

# newest generations per root a leader reports: every one a node may keep for rebuilding
# another (ring.RING_KEEP_MAX), as a lost node's newest replica can be that old
HELD = 4


@dataclass(frozen=True)
class Copy:
    """One leader's copy of a generation: its manifest's sha256, the files it holds, its
    directory below its root, and the shard files every node's load reads (from its
    ``.metadata``)."""

    digest: str
    files: list[str]
    directory: str
    shared: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Transfer:
    path: str  # in the generation
    source: int  # the sending leader's rank; the destination's own: a local copy
    where: str  # on the source: "memory/<directory>" or "replica/<directory>"
    destination: int  # the receiving leader's rank
    load_only: bool = False  # into the destination's fetched directory, not its memory copy


@dataclass(frozen=True)
class ExchangeRoutes:
    generation: str
    manifest: str
    transfers: list[Transfer]


Inventory = dict[str, dict[str, Copy]]  # root ("memory", "replica") -> generation -> copy
Manifests = dict[str, str]  # a manifest's sha256 -> its text


def manifest_digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def inventory(roots: dict[str, list[tuple[str, str]]], paths: dict[str, str]) -> tuple[Inventory, Manifests]:
    """A leader's holdings: per root name, its ``HELD`` newest (generation, directory) whose
    manifest reads; ``paths`` maps a root name to its directory. With the manifests they name."""
    held: Inventory = {}
    manifests: Manifests = {}
    for root_name, found in roots.items():
        held[root_name] = {}
        for name, directory in found:
            if name in held[root_name]:
                continue
            path = os.path.join(paths[root_name], directory)
            try:
                with open(os.path.join(path, MANIFEST_NAME), encoding="utf-8") as handle:
                    raw = handle.read()
            except (OSError, UnicodeDecodeError):
                continue
            digest = manifest_digest(raw)
            manifests[digest] = raw
            held[root_name][name] = Copy(digest, _files_below(path), directory, shared_files(path, name, raw))
            if len(held[root_name]) == HELD:
                break
    return held, manifests


def shared_files(directory: str, generation: str, manifest_raw: str) -> list[str]:
    """The shard files of a generation copy that hold an item stored once for every rank;
    empty when its ``.metadata`` is absent here or does not match the manifest."""
    try:
        manifest = Manifest.from_bytes(manifest_raw.encode(), generation=generation)
        entry = next((f for f in manifest.files if f.path == METADATA_FILE), None)
        location = os.path.join(directory, manifest.location(METADATA_FILE))
        if entry is None:
            return []
        check_entry(generation, METADATA_FILE, entry, *file_digest(location, entry.algorithm))
        metadata = FileSystemReader(os.path.dirname(location)).read_metadata()
    except (OSError, DistCkptError, ValueError, EOFError, AttributeError, ImportError):
        return []
    once = {fqn for fqn, item in metadata.state_dict_metadata.items()
            if isinstance(item, BytesStorageMetadata) or len(item.chunks) == 1}
    return sorted({f"{DCP_DIR}/{info.relative_path}" for index, info in (metadata.storage_data or {}).items()
                   if index.fqn in once})


def _candidates(held: dict[int, Inventory]) -> list[tuple[str, list[tuple[int, str, Copy]]]]:
    """Every generation held, newest first, with its copies (the first one's manifest rules)."""
    names = {n for h in held.values() for root in h.values() for n in root}
    return [(name, [(rank, root, h[root][name]) for rank, h in sorted(held.items())
                    for root in ("memory", "replica") if name in h.get(root, {})])
            for name in sorted(names, key=parse_generation, reverse=True)]


def wanted_manifests(held: dict[int, Inventory], have: Manifests) -> dict[str, int]:
    """Rank 0: the manifests routing reads that it does not hold itself, each with one leader
    that holds it (the lowest rank)."""
    return {copies[0][2].digest: copies[0][0] for _, copies in _candidates(held)
            if copies[0][2].digest not in have}


def route_exchange(held: dict[int, Inventory], manifests: Manifests, leaders: list[int],
                   members: dict[int, set[int]], world_size: int) -> ExchangeRoutes | None:
    """Rank 0: the routes for the newest generation every node can complete; None when
    nothing needs sending or nothing can be completed. ``manifests``: the texts of the
    manifests ``held`` names (a generation whose manifest is absent is passed over)."""
    for name, copies in _candidates(held):
        digest = copies[0][2].digest
        manifest_raw = manifests.get(digest)
        if manifest_raw is None or manifest_digest(manifest_raw) != digest:
            continue
        try:
            manifest = Manifest.from_bytes(manifest_raw.encode(), generation=name)
        except Exception:  # noqa: BLE001 - a damaged copy: the next generation
            continue
        if manifest.world_size != world_size:
            continue  # selection rejects it with its reason
        same = [(rank, f"{root}/{c.directory}", set(c.files), c.shared)
                for rank, root, c in copies if c.digest == digest]
        transfers = _transfers(name, manifest, digest, same, held, leaders, members)
        if transfers is not None:
            return ExchangeRoutes(name, manifest_raw, transfers) if transfers else None
    return None


def _transfers(name: str, manifest: Manifest, digest: str, sources: list, held: dict[int, Inventory],
               leaders: list[int], members: dict[int, set[int]]) -> list[Transfer] | None:
    """The transfers completing ``name`` on every node; None when some node cannot be."""
    shared = next((s for *_, s in sources if s), [])
    writer = {f.path: f.rank for f in manifest.files}
    load: dict[int, int] = {}  # transfers per source so far: spread over the holders
    transfers: list[Transfer] = []
    for leader in leaders:
        ranks = members[leader]
        mine = held.get(leader, {}).get("memory", {}).get(name)
        if mine is not None and mine.digest != digest:
            return None  # another timeline's copy of that name: never mixed
        have = set(mine.files) if mine is not None else set()
        needed = {f.path for f in manifest.files if f.rank in ranks or f.path in COMMON_FILES}
        if 0 in ranks and any(SIGNATURE_NAME in files for _, _, files, _ in sources):
            needed.add(SIGNATURE_NAME)
        for path in sorted(needed - have):
            source = _source(path, leader, name, sources, load)
            if source is None:
                return None
            transfers.append(Transfer(path, *source, leader))
        for path in shared:
            if path in have or path in needed or writer.get(path) in ranks:
                continue
            source = _source(path, leader, name, sources, load)
            if source is not None:  # else the load reports the file it lacks
                transfers.append(Transfer(path, *source, leader, load_only=True))
    return transfers


def _source(path: str, leader: int, name: str, sources: list, load: dict[int, int]) -> tuple[int, str] | None:
    """The least-loaded holder of ``path``; the leader's own replica first (a local copy)."""
    holders = [(rank, where) for rank, where, files, _ in sources
               if path in files and (rank, where) != (leader, f"memory/{name}")]
    if not holders:
        return None
    rank, where = min(holders, key=lambda h: (h[0] != leader, load.get(h[0], 0), h[0], h[1]))
    load[rank] = load.get(rank, 0) + 1
    return rank, where


def _files_below(directory: str) -> list[str]:
    found = []
    for parent, _dirs, files in os.walk(directory):
        for name in files:
            found.append(os.path.relpath(os.path.join(parent, name), directory))
    return sorted(found)
