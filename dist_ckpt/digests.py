"""File digests: the algorithms a manifest may name, and how each is computed.

New generations use BLAKE3 (cryptographic, less CPU per byte than sha256, docs/performance.md;
and its ``update`` releases the GIL, so hashing beside a write or a read does not stall Python
threads). Manifests written with sha256 still verify: every manifest entry names its
algorithm by its key (``"blake3"`` or ``"sha256"``).
"""

from __future__ import annotations

import hashlib
from typing import Literal, Protocol

import blake3

DigestAlgorithm = Literal["blake3", "sha256"]
ALGORITHMS: tuple[str, ...] = ("blake3", "sha256")
DEFAULT_ALGORITHM: DigestAlgorithm = "blake3"
HASH_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def hasher(algorithm: str, *, threads: int = 1) -> Hasher:
    """A fresh incremental hasher. ``threads`` > 1 lets BLAKE3 hash one large update on
    several cores (restore verification); a save's writer hashes on one core so that it
    takes as little as possible from training."""
    if algorithm == "blake3":
        return blake3.blake3(max_threads=threads if threads > 1 else 1)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def digest_bytes(data: bytes | memoryview, algorithm: str) -> str:
    digest = hasher(algorithm)
    digest.update(data)
    return digest.hexdigest()
