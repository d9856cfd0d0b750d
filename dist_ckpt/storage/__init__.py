"""Storage: bytes and names below a root (a POSIX directory or an fsspec object store).

Owns: durable local writes (fsync, atomic replace) and object-store access. May import:
``errors``, ``logs``. Knows nothing of manifests, generations or DCP.
"""

from .base import Store, StoreReader, StoreWriter, open_store

__all__ = ["Store", "StoreReader", "StoreWriter", "open_store"]
