"""Quarantine: a generation, or the damaged files a restore's repair replaced, moved aside under
``ROOT/rejected/`` (one word for the act; the directory keeps its public name). Entry names are
built and parsed in ``format/manifest.py`` (``RejectedEntry``); moving entries there and back
is the tiers' (``tiers/rejected.py``, ``tiers/rejected_store.py``).

Here: the entries under a root (``list_quarantined``), the first line of an entry's
``reason.txt``, and two read-only views that let ``validate`` check a quarantined generation's
bytes as the generation they were: in its entry (``EntryView``), and copied back into place
before its manifest is (``StagedView``, an object store's put-back).
"""

from __future__ import annotations

from typing import IO

from ..errors import StorageError
from ..storage.base import StoreReader
from .manifest import (
    MANIFEST_NAME,
    REASON_NAME,
    REJECTED_DIR,
    RejectedEntry,
    is_object_path,
    parse_generation,
    parse_rejected_entry,
)

MAX_REASON_SHOWN = 1000  # bytes of reason.txt read for its first line


def list_quarantined(store: StoreReader) -> list[RejectedEntry]:
    """Every entry below ``ROOT/rejected/`` whose name is one the library gives (both kinds),
    newest update number first and, for one generation, the newest quarantine first; [] when
    there is none or the directory cannot be read."""
    try:
        names = store.listdir(REJECTED_DIR) if store.exists(REJECTED_DIR) else []
    except (StorageError, OSError):
        return []
    entries = [entry for entry in map(parse_rejected_entry, names) if entry is not None]
    return sorted(entries, key=lambda e: (parse_generation(e.generation) or 0, e.time, e.name),
                  reverse=True)


def reason_line(store: StoreReader, entry: RejectedEntry) -> str:
    """The first line of the entry's ``reason.txt`` (why it was quarantined), for a listing."""
    try:
        raw = store.read_bytes(f"{entry.path}/{REASON_NAME}")[:MAX_REASON_SHOWN]
    except (FileNotFoundError, StorageError, OSError):
        return f"(no {REASON_NAME})"
    text = raw.decode("utf-8", errors="replace")
    return text.splitlines()[0].strip() if text.strip() else "(empty reason)"


class _RenamedView:
    """A read-only store whose paths ``_rel`` maps to others of the same store."""

    def __init__(self, store: StoreReader, entry: RejectedEntry) -> None:
        self.store = store
        self.entry = entry.path
        self.generation = entry.generation
        self.root = store.url(entry.path)

    def _rel(self, rel: str) -> str:
        raise NotImplementedError

    def url(self, rel: str) -> str:
        return self.store.url(self._rel(rel))

    def exists(self, rel: str) -> bool:
        return self.store.exists(self._rel(rel))

    def listdir(self, rel: str) -> list[str]:
        return self.store.listdir(self._rel(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.store.read_bytes(self._rel(rel))

    def open_read(self, rel: str) -> IO[bytes]:
        return self.store.open_read(self._rel(rel))

    def size(self, rel: str) -> int:
        return self.store.size(self._rel(rel))

    def checked_size(self, rel: str, *, limit: int | None = None,
                     sound_dirs: set[str] | None = None) -> int:
        return self.store.checked_size(self._rel(rel), limit=limit, sound_dirs=sound_dirs)

    def digest(self, rel: str, algorithm: str) -> str:
        return self.store.digest(self._rel(rel), algorithm)

    def tree_size(self, rel: str) -> int:
        return self.store.tree_size(self._rel(rel))

    def local_path(self, rel: str) -> str | None:
        return self.store.local_path(self._rel(rel))


class EntryView(_RenamedView):
    """A quarantined generation's entry seen under its generation's name, so that ``validate``
    checks it unchanged (its manifest still names the generation). A shared object
    (``objects/<name>``) is read where every generation reads it, at the root: a quarantined
    manifest keeps the objects it lists (``format/objects.py``)."""

    def _rel(self, rel: str) -> str:
        if is_object_path(rel):
            return rel
        first, _, rest = rel.partition("/")
        if first != self.generation:
            raise FileNotFoundError(f"{rel} is not inside {self.generation}")
        return f"{self.entry}/{rest}" if rest else self.entry


class StagedView(_RenamedView):
    """A quarantined generation copied back to ``ROOT/<generation>/`` but for its manifest,
    which is read from the entry: what the generation will be once the manifest is created."""

    def _rel(self, rel: str) -> str:
        return f"{self.entry}/{MANIFEST_NAME}" if rel == f"{self.generation}/{MANIFEST_NAME}" else rel
