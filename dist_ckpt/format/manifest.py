"""Schemas of the generation manifest and the latest pointer, and generation naming.

A generation directory is named ``gen-<next_update, 12 digits>``; its ``manifest.json`` is
written last and lists every file with its size and sha256. ``latest.json`` at the root
points at the newest validated generation.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from ..errors import UnsafeNameError, ValidationError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest.json"
DCP_DIR = "dcp"
STATE_DIR = "state"
GLOBAL_STATE_FILE = f"{STATE_DIR}/train_state.json"
METADATA_FILE = f"{DCP_DIR}/.metadata"  # DCP's pickled metadata, written by rank 0
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 1_000_000
PENDING_PREFIX = ".pending-"

_GEN_RE = re.compile(r"^gen-(\d{12})$")
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.\-]*$")


def generation_name(next_update: int) -> str:
    if not 0 <= next_update < 10**12:
        raise ValueError(f"next_update {next_update} out of range")
    return f"gen-{next_update:012d}"


def parse_generation(name: str) -> int | None:
    """The update number of a generation name, or None when ``name`` is not one."""
    match = _GEN_RE.match(name)
    return int(match.group(1)) if match else None


def check_generation_name(name: str) -> int:
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise UnsafeNameError(f"unsafe generation name {name!r} (path traversal)", generation=name)
    number = parse_generation(name)
    if number is None:
        raise UnsafeNameError(f"{name!r} is not a generation name (gen-NNNNNNNNNNNN)",
                              generation=name)
    return number


def check_relative_path(path: str) -> str:
    """Reject absolute paths, traversal and odd characters in a file name from a manifest."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(
        p in ("", ".", "..") or not _SAFE_PART.match(p) for p in parts
    ):
        raise UnsafeNameError(f"unsafe file name {path!r} in manifest", path=path)
    return path


def rank_state_file(rank: int) -> str:
    return f"{STATE_DIR}/rank-{rank:05d}.json"


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    rank: int = Field(ge=0)


class Manifest(BaseModel):
    """Written last into a generation; its presence is what makes a generation committed."""

    model_config = ConfigDict(extra="forbid")
    format_version: int
    generation: str
    kind: Literal["resume", "warm_start"] = "resume"
    next_update: int = Field(ge=0)
    tokens_seen: int = Field(ge=0)
    world_size: int = Field(ge=1)
    components: list[str]
    contract: dict[str, str]
    contract_digest: str
    torch_version: str
    dist_ckpt_version: str
    created_unix: float
    save_duration_s: float
    total_bytes: int = Field(ge=0)
    # object stores have no rename: each save attempt writes below its own data directory
    # so two writers of one generation never mix objects; "" on a POSIX filesystem
    data_dir: str = ""
    files: list[FileEntry]

    def location(self, path: str) -> str:
        """Where a listed file lives, relative to the generation directory."""
        return f"{self.data_dir}/{path}" if self.data_dir else path

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=1).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes, *, generation: str) -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValidationError(f"manifest of {generation} is {len(raw)} bytes, over the bound",
                                  generation=generation, path=MANIFEST_NAME)
        try:
            manifest = cls.model_validate_json(raw)
        except PydanticValidationError as exc:
            raise ValidationError(f"manifest of {generation} is corrupt: {exc.errors()[0]['msg']}",
                                  generation=generation, path=MANIFEST_NAME) from exc
        if manifest.format_version != FORMAT_VERSION:
            raise ValidationError(
                f"manifest of {generation} has format {manifest.format_version}, "
                f"this dist_ckpt reads {FORMAT_VERSION}", generation=generation, path=MANIFEST_NAME)
        if manifest.generation != generation:
            raise ValidationError(f"manifest names {manifest.generation!r}, found in {generation!r}",
                                  generation=generation, path=MANIFEST_NAME)
        if len(manifest.files) > MAX_FILES:
            raise ValidationError(f"manifest of {generation} lists too many files",
                                  generation=generation, path=MANIFEST_NAME)
        for entry in manifest.files:
            check_relative_path(entry.path)
        if manifest.data_dir:
            check_relative_path(manifest.data_dir)
        return manifest

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)


class LatestPointer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generation: str
    manifest_sha256: str
    manifest_size: int
    format_version: int
    next_update: int

    @staticmethod
    def replaces(current_raw: bytes | None, manifest: Manifest) -> bool:
        """Whether a pointer at ``manifest`` should replace the pointer ``current_raw``: it
        never moves back to an older generation; a missing or corrupt pointer is replaced
        (restore never trusts the pointer over validation)."""
        if current_raw is None:
            return True
        try:
            current = LatestPointer.model_validate_json(current_raw)
        except ValueError:
            return True
        return current.next_update <= manifest.next_update

    @classmethod
    def for_manifest(cls, manifest: Manifest, raw: bytes) -> LatestPointer:
        return cls(generation=manifest.generation, manifest_sha256=hashlib.sha256(raw).hexdigest(),
                   manifest_size=len(raw), format_version=manifest.format_version,
                   next_update=manifest.next_update)


def read_latest_name(backend: Any) -> str | None:
    """The generation ``latest.json`` under ``backend`` names; None when absent or unreadable
    (the pointer is a hint: nothing trusts it over validation)."""
    try:
        return LatestPointer.model_validate_json(backend.read_bytes(LATEST_NAME)).generation
    except Exception:  # noqa: BLE001 - missing, unreadable or corrupt: no hint
        return None
