"""What is under a root: every generation with its state (committed / pending / invalid)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError
from ..storage.base import Backend
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


def inspect_generation(backend: Backend, name: str, *, digests: bool,
                       key: bytes | None = None) -> GenerationInfo:
    number = parse_generation(name)
    try:
        manifest = validate(backend, name, digests=digests, key=key)
    except ValidationError as exc:
        return GenerationInfo(name, number, "invalid", reason=str(exc), path=exc.path)
    except OSError as exc:
        return GenerationInfo(name, number, "invalid", reason=f"unreadable: {exc}")
    return GenerationInfo(name, number, "committed", manifest.total_bytes, manifest=manifest)


def inventory(backend: Backend, *, digests: bool, key: bytes | None = None) -> list[GenerationInfo]:
    """Every generation and pending directory; with ``key``, unsigned manifests are invalid."""
    infos = [inspect_generation(backend, name, digests=digests, key=key)
             for name in list_generations(backend)]
    for name in list_pending(backend):
        infos.append(GenerationInfo(name, None, "pending", reason="not committed (in flight "
                                                                  "or abandoned)"))
    return infos


def newest_committed(backend: Backend, key: bytes | None = None) -> str | None:
    """The newest generation whose structure and sizes check out (what restore tries first,
    before digests), or None."""
    for name in list_generations(backend):
        if inspect_generation(backend, name, digests=False, key=key).state == "committed":
            return name
    return None


def is_committed(store: Backend, name: str, key: bytes | None = None) -> bool:
    """Whether generation ``name`` is committed in ``store``: its manifest exists and the
    structure and sizes check out (digests are not read)."""
    if not store.exists(f"{name}/{MANIFEST_NAME}"):
        return False
    return inspect_generation(store, name, digests=False, key=key).state == "committed"
