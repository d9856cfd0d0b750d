"""Validation of a generation: structure, then sizes, then digests against its manifest.

A generation is trusted only if its manifest parses, names only safe relative paths, lists
the files every component needs, and every listed file has the recorded size (and, for the
integrity level, the recorded sha256). Nothing here deserialises a pickle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .. import progress
from ..errors import StorageError, ValidationError
from ..storage.base import Backend
from .manifest import (
    GLOBAL_STATE_FILE,
    MANIFEST_NAME,
    PENDING_PREFIX,
    Manifest,
    check_generation_name,
    parse_generation,
    rank_state_file,
)
from .signing import SIGNATURE_NAME, verify


@dataclass
class Problem:
    generation: str
    reason: str
    path: str | None = None
    tier: str | None = None  # the root (local or mirror) the generation was read from
    signature: bool = False  # rejected by the signing key (not by its bytes)

    def __str__(self) -> str:
        where = f" ({self.path})" if self.path else ""
        tier = f" [{self.tier}]" if self.tier else ""
        return f"{self.generation}{where}{tier}: {self.reason}"


def list_generations(backend: Backend) -> list[str]:
    """Generation directory names, newest first by parsed update number (never lexically)."""
    names = [n for n in backend.listdir("") if parse_generation(n) is not None]
    return sorted(names, key=lambda n: parse_generation(n) or 0, reverse=True)


def list_pending(backend: Backend) -> list[str]:
    return [n for n in backend.listdir("") if n.startswith(PENDING_PREFIX)]


def read_manifest(backend: Backend, generation: str, *, key: bytes | None = None) -> Manifest:
    """Parse a generation's manifest; with ``key``, only if its signature verifies."""
    check_generation_name(generation)
    rel = f"{generation}/{MANIFEST_NAME}"
    try:
        raw = backend.read_bytes(rel)
    except (FileNotFoundError, StorageError) as exc:
        raise ValidationError(f"{generation} has no manifest (never committed)",
                              generation=generation, path=MANIFEST_NAME) from exc
    manifest = Manifest.from_bytes(raw, generation=generation)
    if key is not None:
        try:
            signature: bytes | None = backend.read_bytes(
                f"{generation}/{manifest.location(SIGNATURE_NAME)}")
        except (FileNotFoundError, StorageError):
            signature = None
        verify(key, raw, signature, generation=generation)
    return manifest


def check_structure(backend: Backend, generation: str, *, key: bytes | None = None) -> Manifest:
    manifest = read_manifest(backend, generation, key=key)
    listed = {f.path for f in manifest.files}
    required = {"dcp/.metadata", GLOBAL_STATE_FILE}
    required |= {rank_state_file(r) for r in range(manifest.world_size)}
    missing = sorted(required - listed)
    if missing:
        raise ValidationError(f"{generation} manifest lacks required file(s) {missing}",
                              generation=generation, path=missing[0])
    if parse_generation(generation) != manifest.next_update:
        raise ValidationError(f"{generation} manifest says next_update={manifest.next_update}",
                              generation=generation, path=MANIFEST_NAME)
    return manifest


def check_sizes(backend: Backend, generation: str, manifest: Manifest) -> None:
    for entry in manifest.files:
        rel = f"{generation}/{manifest.location(entry.path)}"
        try:
            size = backend.size(rel)
        except (FileNotFoundError, StorageError) as exc:
            raise ValidationError(f"{generation}: file {entry.path} is missing",
                                  generation=generation, path=entry.path) from exc
        if size != entry.size:
            raise ValidationError(
                f"{generation}: file {entry.path} has {size} bytes, manifest says {entry.size}",
                generation=generation, path=entry.path)


def check_digests(backend: Backend, generation: str, manifest: Manifest,
                  paths: Iterable[str] | None = None) -> None:
    wanted = None if paths is None else set(paths)
    for entry in manifest.files:
        if wanted is not None and entry.path not in wanted:
            continue
        digest = backend.sha256(f"{generation}/{manifest.location(entry.path)}")
        progress.advance(entry.size)
        if digest != entry.sha256:
            raise ValidationError(f"{generation}: file {entry.path} has sha256 {digest[:12]}..., "
                                  f"manifest says {entry.sha256[:12]}...",
                                  generation=generation, path=entry.path)


def validate(backend: Backend, generation: str, *, digests: bool = True,
             key: bytes | None = None) -> Manifest:
    """Full validation of one generation on one process; raises ``ValidationError``."""
    manifest = check_structure(backend, generation, key=key)
    check_sizes(backend, generation, manifest)
    if digests:
        check_digests(backend, generation, manifest)
    return manifest


def problem_of(exc: Exception, generation: str) -> Problem:
    return Problem(generation, str(exc), getattr(exc, "path", None))
