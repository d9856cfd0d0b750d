"""What is under a root: every generation with its state (committed / pending / invalid)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError
from ..storage.base import StoreReader
from .manifest import MANIFEST_NAME, Manifest, parse_generation
from .validate import list_generations, list_pending, validate


@dataclass
class GenerationInfo:
    name: str
    next_update: int | None
    state: str  # committed | pending | invalid
    total_bytes: int | None = None
    reason: str | None = None
    path: str | None = None
    manifest: Manifest | None = None

    @property
    def own_bytes(self) -> int | None:
        """Bytes of the files below the generation itself (what deleting it frees); None
        without a valid manifest."""
        return None if self.manifest is None else sum(f.size for f in self.manifest.own_files)

    @property
    def referenced_bytes(self) -> int | None:
        """Bytes of the shared objects it references (``ROOT/objects/``, kept while any
        generation lists them); None without a valid manifest."""
        return None if self.manifest is None else sum(f.size for f in self.manifest.objects)


def inspect_generation(store: StoreReader, name: str, *, digests: bool,
                       key: bytes | None = None) -> GenerationInfo:
    number = parse_generation(name)
    try:
        manifest = validate(store, name, digests=digests, key=key)
    except ValidationError as exc:
        return GenerationInfo(name, number, "invalid", reason=str(exc), path=exc.path)
    except OSError as exc:
        return GenerationInfo(name, number, "invalid", reason=f"unreadable: {exc}")
    return GenerationInfo(name, number, "committed", manifest.total_bytes, manifest=manifest)


def is_committed(store: StoreReader, name: str, key: bytes | None = None) -> bool:
    """Whether generation ``name`` is committed in ``store``: its manifest is there, and the
    structure and sizes check out (digests are not read; with ``key``, only if signed by it).
    The one answer to the question, for every caller that asks it."""
    return store.exists(f"{name}/{MANIFEST_NAME}") \
        and inspect_generation(store, name, digests=False, key=key).state == "committed"


def inventory(store: StoreReader, *, digests: bool, key: bytes | None = None) -> list[GenerationInfo]:
    """Every generation and pending directory; with ``key``, unsigned manifests are invalid."""
    infos = [inspect_generation(store, name, digests=digests, key=key)
             for name in list_generations(store)]
    for name in list_pending(store):
        infos.append(GenerationInfo(name, None, "pending", reason="not committed (in flight "
                                                                  "or abandoned)"))
    return infos


def newest_committed(store: StoreReader, key: bytes | None = None) -> str | None:
    """The newest generation whose structure and sizes check out (what restore tries first,
    before digests), or None."""
    return next((name for name in list_generations(store) if is_committed(store, name, key)), None)
