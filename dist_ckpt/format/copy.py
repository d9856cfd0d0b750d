"""One listed file of a committed generation copied durably, hashed on the way.

Bytes that no longer match the manifest (a bit flipped in memory, a file changed since its
save) never reach the target: the copy raises ``ValidationError`` and the partial target is
the caller's to discard. Torch-free: the launcher's persist at breakpoint uses it as well as
the tiers' replays.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..digests import hasher
from ..storage.local import open_regular
from .manifest import FileEntry, is_object_path
from .validate import check_entry

COPY_CHUNK = 8 << 20


def listed_source(generation_dir: str, path: str) -> str:
    """Where listed file ``path`` of the committed generation in ``generation_dir`` (a local
    tier's ``ROOT/G``) lies: a shared object in that tier's ``ROOT/objects/<name>``, beside
    the generation (``Manifest.where``), every other file below ``generation_dir``."""
    if is_object_path(path):
        return os.path.join(os.path.dirname(os.path.normpath(generation_dir)), path)
    return os.path.join(generation_dir, path)


@contextmanager
def fsynced_file(path: str) -> Iterator[Any]:
    """A new file at ``path``, fsynced when the block ends without an error."""
    with open(path, "wb") as sink:
        yield sink
        sink.flush()
        os.fsync(sink.fileno())


def copy_verified(source: str, target: str, entry: FileEntry, generation: str, *,
                  open_target: Callable[[str], AbstractContextManager[Any]] = fsynced_file) -> None:
    """Copy ``source`` (a regular file, never through a link) to the new file ``target``,
    checked against ``entry`` of ``generation``. ``open_target`` makes the durable sink (its
    ``write`` takes a memoryview; the file is durable when its block ends)."""
    digest = hasher(entry.algorithm)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    size = 0
    with open_regular(source) as src, open_target(target) as sink:
        while chunk := src.read(COPY_CHUNK):
            digest.update(chunk)
            sink.write(memoryview(chunk))
            size += len(chunk)
    check_entry(generation, entry.path, entry, size, digest.hexdigest())
