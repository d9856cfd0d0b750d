"""Schemas of the generation manifest and the latest pointer, and the names of a root.

A generation directory is named ``gen-<next_update, 12 digits>``; its ``manifest.json`` is
written last and lists every file with its size and digest (BLAKE3; sha256 in older
generations). ``latest.json`` at the root points at the newest validated generation. Every
other name the library gives below a root is built and parsed here too: an attempt's pending
directory ``.pending-G-<attempt>``, a rejected generation's ``rejected/G-<time>-<id>/``, the
damaged files a restore replaced, ``rejected/G-files-<time>-<id>/`` and, on a store without
rename, the marker ``G/rejected-<manifest sha256>.json``.

Everything read here may be hostile: parsers raise ``ValidationError`` (never another
exception), and ``regular_file_size`` refuses, without opening it, anything below a local root
that is not a regular file (a FIFO would block its reader forever, a link could leave the root).
"""

from __future__ import annotations

import calendar
import hashlib
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator
from pydantic import ValidationError as PydanticValidationError

from ..errors import StorageError, UnsafeFileError, UnsafeNameError, ValidationError
from ..storage.base import StoreReader, read_bounded

FORMAT_VERSION = 2  # 2: an entry's digest may be blake3
# 3: the manifest may list shared objects (``OBJECTS_DIR``) that other generations reference too;
# written only by a generation that lists one, so that older readers refuse it instead of
# looking for the objects inside the generation
INCREMENTAL_FORMAT_VERSION = 3
READABLE_FORMATS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest.json"
DCP_DIR = "dcp"
STATE_DIR = "state"
GLOBAL_STATE_FILE = f"{STATE_DIR}/train_state.json"
METADATA_NAME = ".metadata"  # DCP's pickled metadata, written by rank 0
METADATA_FILE = f"{DCP_DIR}/{METADATA_NAME}"
COMMON_FILES = frozenset({METADATA_FILE, GLOBAL_STATE_FILE})  # rank 0 writes them, every rank reads them
# Shared objects of incremental generations (docs/incremental.md): one frozen tensor item's
# DCP record, named by the digest of its bytes, at ``<tier root>/objects/<digest>.distcp``
# and listed, with its size and digest, by every generation that references it. Its manifest
# path is ``objects/<name>``; DCP's metadata reaches it from the generation's ``dcp/``
# directory as ``../../objects/<name>``, so plain ``dcp.load`` of a generation on a POSIX
# root reads it where it lies.
OBJECTS_DIR = "objects"
OBJECT_SUFFIX = ".distcp"
DCP_OBJECT_PREFIX = f"../../{OBJECTS_DIR}/"
_OBJECT_RE = re.compile(rf"{OBJECTS_DIR}/([0-9a-f]{{64}}){re.escape(OBJECT_SUFFIX)}")
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILES = 1_000_000
MAX_POINTER_BYTES = 64 << 10  # latest.json is about 200 bytes
MAX_UNIX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z, the last second datetime can show
PENDING_PREFIX = ".pending-"
REJECTED_DIR = "rejected"  # rejected generations moved aside, below the root
REASON_NAME = "reason.txt"  # in a rejected entry: why it was moved aside
# in a generation on a store without rename: its manifest (by sha256) was rejected and is
# being moved aside; readers treat that manifest as rejected (``rejected_marker_name``)
REJECTED_MARKER_PREFIX = "rejected-"

# fullmatch, ASCII digits only: "$" would accept a trailing newline and "\d" any Unicode digit
_GEN_RE = re.compile(r"gen-([0-9]{12})")
_PENDING_RE = re.compile(rf"{re.escape(PENDING_PREFIX)}gen-([0-9]{{12}})(?:-|\Z)")  # match
# both kinds of entry: a generation (G-<time>-<id>) and the damaged files of one (G-files-<time>-<id>)
_REJECTED_RE = re.compile(r"(gen-[0-9]{12})-(files-)?([0-9]{8}T[0-9]{6}Z)-[0-9a-f]{6}")
_ENTRY_TIME = "%Y%m%dT%H%M%SZ"  # UTC, in a rejected entry's name
_SAFE_PART = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.\-]*")


def _short(value: Any) -> str:
    """A name from hostile bytes, fit for a message: repr (escapes controls), at most 80."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def generation_name(next_update: int) -> str:
    if not 0 <= next_update < 10**12:
        raise ValueError(f"next_update {next_update} out of range")
    return f"gen-{next_update:012d}"


_SHORT_GENERATION = re.compile(r"(?:gen-)?([0-9]{1,12})")


def expand_generation_name(name: str) -> str:
    """A generation name as a person types it: ``3300``, ``gen-3300`` and ``gen-000000003300``
    all name ``gen-000000003300``. Anything else comes back unchanged (a name, never a path)."""
    match = _SHORT_GENERATION.fullmatch(name)
    return generation_name(int(match.group(1))) if match else name


def parse_generation(name: str) -> int | None:
    """The update number of a generation name, or None when ``name`` is not one."""
    match = _GEN_RE.fullmatch(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


def pending_dir_name(generation: str, attempt_id: str) -> str:
    """The private local directory of an attempt (renamed to ``generation`` on commit in a
    rename tier; scratch before upload in an object-store tier)."""
    return f"{PENDING_PREFIX}{generation}-{attempt_id}"


def pending_update(name: str) -> int | None:
    """The update number of a pending directory's name, or None when ``name`` is not one."""
    match = _PENDING_RE.match(name) if isinstance(name, str) else None
    return int(match.group(1)) if match else None


def rejected_entry_name(generation: str) -> str:
    """A new name below ``REJECTED_DIR`` for ``generation``: ``<generation>-<UTC time>-<6 hex>``
    (one generation may be moved aside more than once)."""
    return f"{generation}-{_entry_suffix()}"


def _entry_suffix() -> str:
    return f"{time.strftime(_ENTRY_TIME, time.gmtime())}-{uuid.uuid4().hex[:6]}"


def rejected_files_entry_name(generation: str) -> str:
    """A new name below ``REJECTED_DIR`` for damaged files of ``generation`` that restore
    replaced with a good copy (``dist_ckpt.restore.repair``): ``<generation>-files-<UTC
    time>-<6 hex>``. Not a rejected generation: the generation itself stays committed."""
    return f"{generation}-files-{_entry_suffix()}"


def rejected_marker_name(manifest_sha256: str) -> str:
    """The marker, inside a generation, saying that the manifest with this sha256 was rejected
    (``dist_ckpt.tiers.rejected_store``): a later manifest of the same generation has another."""
    return f"{REJECTED_MARKER_PREFIX}{manifest_sha256}.json"


@dataclass(frozen=True)
class RejectedEntry:
    """An entry below ``REJECTED_DIR`` (a quarantine), as its name says: a generation moved
    aside (``kind`` "generation": ``rejected_entry_name``) or the damaged files a restore's
    repair replaced in a generation that stayed committed ("files": ``rejected_files_entry_name``)."""

    name: str  # the entry's directory below REJECTED_DIR
    generation: str
    kind: Literal["generation", "files"]
    time: float  # when it was quarantined: UNIX time, whole UTC seconds (from the name)

    @property
    def path(self) -> str:
        """Relative to the root: ``rejected/<name>``."""
        return f"{REJECTED_DIR}/{self.name}"

    @property
    def time_text(self) -> str:
        """The time, ISO 8601 in UTC (``2026-01-31T12:00:00Z``)."""
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time))


def parse_rejected_entry(entry: str) -> RejectedEntry | None:
    """The entry named ``entry`` below ``REJECTED_DIR`` (either kind), or None when the name is
    not one the library gives (a path, traversal, another name, an impossible time)."""
    match = _REJECTED_RE.fullmatch(entry) if isinstance(entry, str) else None
    if match is None:
        return None
    try:
        moved = calendar.timegm(time.strptime(match.group(3), _ENTRY_TIME))
    except ValueError:
        return None
    return RejectedEntry(entry, match.group(1), "files" if match.group(2) else "generation", float(moved))


def rejected_generation(entry: str) -> str | None:
    """The generation an entry below ``REJECTED_DIR`` holds, or None when ``entry`` is not a
    rejected generation's (a files entry holds no generation)."""
    parsed = parse_rejected_entry(entry)
    return parsed.generation if parsed is not None and parsed.kind == "generation" else None


def check_generation_name(name: str) -> int:
    if not isinstance(name, str):
        raise UnsafeNameError(f"generation name {_short(name)} is not a string", generation=_short(name))
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise UnsafeNameError(f"unsafe generation name {_short(name)} (path traversal)", generation=name)
    number = parse_generation(name)
    if number is None:
        raise UnsafeNameError(f"{_short(name)} is not a generation name (gen-NNNNNNNNNNNN)",
                              generation=name)
    return number


def check_relative_path(path: str) -> str:
    """Reject absolute paths, traversal and odd characters in a file name from a manifest."""
    if not isinstance(path, str):
        raise UnsafeNameError(f"file name {_short(path)} in manifest is not a string", path=_short(path))
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(
        p in ("", ".", "..") or not _SAFE_PART.fullmatch(p) for p in parts
    ):
        raise UnsafeNameError(f"unsafe file name {_short(path)} in manifest", path=path)
    return path


def regular_file_size(store: StoreReader, rel: str, *, generation: str | None = None,
                      path: str | None = None, limit: int | None = None,
                      checked_dirs: set[str] | None = None) -> int:
    """The size of ``rel`` through the store's ``checked_size``: a regular file reached
    without links (a FIFO is never opened, a link never followed), at most ``limit`` bytes.
    Raises ``UnsafeFileError`` naming ``path`` (default ``rel``) in ``generation``, or
    ``FileNotFoundError``. ``checked_dirs`` caches directories a store already found sound."""
    try:
        return store.checked_size(rel, limit=limit, sound_dirs=checked_dirs)
    except UnsafeFileError as exc:
        shown = path or rel
        raise UnsafeFileError(f"{generation + ': ' if generation else ''}{shown}: {exc}",
                              generation=generation, path=shown) from None


def _parse_failure(exc: Exception) -> str:
    """What a schema's parser refused, fit for a message (the first error only)."""
    if not isinstance(exc, PydanticValidationError):  # whatever the parser did not wrap
        return type(exc).__name__
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "unreadable"}
    field = ascii(".".join(str(part) for part in first["loc"]))[1:-1][:80]  # escapes controls
    return f"{field + ': ' if field else ''}{first['msg']}"


def _check_listed_path(path: str, generation: str) -> None:
    try:
        check_relative_path(path)
    except UnsafeNameError as exc:
        raise UnsafeNameError(f"{generation}: {MANIFEST_NAME} lists unsafe file name {_short(path)} "
                              "(absolute path, traversal or odd characters)",
                              generation=generation, path=MANIFEST_NAME) from exc


def object_path(digest: str) -> str:
    """The manifest path of the shared object whose bytes have this digest (64 hex)."""
    path = f"{OBJECTS_DIR}/{digest}{OBJECT_SUFFIX}"
    if not _OBJECT_RE.fullmatch(path):
        raise ValueError(f"{digest!r} is not a 64-hex digest")
    return path


def is_object_path(path: str) -> bool:
    """Whether a manifest path names a shared object (``objects/<64 hex>.distcp``)."""
    return isinstance(path, str) and _OBJECT_RE.fullmatch(path) is not None


def dcp_entry_path(rel: str) -> str:
    """The manifest path of a file DCP's metadata names ``rel`` (relative to ``dcp/``):
    ``dcp/<rel>``, or ``objects/<name>`` for a shared object (``../../objects/<name>``)."""
    if rel.startswith(DCP_OBJECT_PREFIX):
        path = rel[len("../../"):]
        if is_object_path(path):
            return path
    return f"{DCP_DIR}/{rel}"


def dcp_relative_path(path: str) -> str:
    """The inverse of :func:`dcp_entry_path`: what DCP's metadata names a listed file."""
    if is_object_path(path):
        return f"../../{path}"
    return path.removeprefix(f"{DCP_DIR}/")


def rank_state_file(rank: int) -> str:
    return f"{STATE_DIR}/rank-{rank:05d}.json"


class FileEntry(BaseModel):
    """One listed file. Its digest's key names the algorithm: ``blake3`` (new generations)
    or ``sha256`` (generations written before BLAKE3, and ``digest_algorithm="sha256"``)."""

    model_config = ConfigDict(extra="forbid")
    path: str
    size: int = Field(ge=0)
    blake3: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    rank: int = Field(ge=0)

    @model_validator(mode="after")
    def _one_digest(self) -> FileEntry:
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("needs exactly one digest (blake3 or sha256)")
        return self

    @property
    def algorithm(self) -> str:
        return "blake3" if self.blake3 is not None else "sha256"

    @property
    def digest(self) -> str:
        digest = self.blake3 if self.blake3 is not None else self.sha256
        assert digest is not None
        return digest

    @classmethod
    def of(cls, path: str, size: int, algorithm: str, digest: str, rank: int) -> FileEntry:
        return cls(path=path, size=size, rank=rank, **{algorithm: digest})


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
    # the canonical JSON of the contract's fields (those within restart.contract's bound), so
    # that a mismatch names the key and both values; absent in older manifests and when empty
    contract_values: dict[str, JsonValue] | None = None
    torch_version: str
    dist_ckpt_version: str
    created_unix: float = Field(ge=0, le=MAX_UNIX_TIME, allow_inf_nan=False)  # shown as a date
    save_duration_s: float = Field(allow_inf_nan=False)
    total_bytes: int = Field(ge=0)
    # object stores have no rename: each save attempt writes below its own data directory
    # so two writers of one generation never mix objects; "" on a POSIX filesystem
    data_dir: str = ""
    files: list[FileEntry]

    def location(self, path: str) -> str:
        """Where a generation's own file lives, relative to the generation directory (a
        shared object lives outside it: :meth:`where`)."""
        return f"{self.data_dir}/{path}" if self.data_dir else path

    def where(self, path: str) -> str:
        """Where a listed file lives, relative to the tier's root: a shared object at
        ``objects/<name>``, every other file below the generation."""
        if is_object_path(path):
            return path
        return f"{self.generation}/{self.location(path)}"

    @property
    def objects(self) -> list[FileEntry]:
        """The shared objects this generation references (its incremental part)."""
        return [f for f in self.files if is_object_path(f.path)]

    @property
    def own_files(self) -> list[FileEntry]:
        """The files that live below the generation itself."""
        return [f for f in self.files if not is_object_path(f.path)]

    def to_bytes(self) -> bytes:
        # an entry carries only its own algorithm's digest
        return self.model_dump_json(indent=1, exclude_none=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes, *, generation: str) -> Manifest:
        """Parse and check a manifest: any bytes give a ``Manifest`` or a ``ValidationError``
        naming ``generation`` and its ``manifest.json`` (``UnsafeNameError`` for a file name
        that could leave the generation)."""
        where = f"{generation}: {MANIFEST_NAME}"

        def invalid(why: str) -> ValidationError:
            return ValidationError(f"{where} {why}", generation=generation, path=MANIFEST_NAME)

        if len(raw) > MAX_MANIFEST_BYTES:
            raise invalid(f"is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} byte bound")
        try:
            manifest = cls.model_validate_json(raw)
        except (ValueError, TypeError, RecursionError) as exc:
            raise invalid(f"is corrupt: {_parse_failure(exc)}") from exc
        if manifest.format_version not in READABLE_FORMATS:
            raise invalid(f"has format {manifest.format_version}, this dist_ckpt reads "
                          f"{', '.join(map(str, READABLE_FORMATS))}")
        if manifest.generation != generation:
            raise invalid(f"names {_short(manifest.generation)}, found in {generation!r}")
        if len(manifest.files) > MAX_FILES:
            raise invalid(f"lists {len(manifest.files)} files, over the bound of {MAX_FILES}")
        seen: set[str] = set()
        for entry in manifest.files:
            _check_listed_path(entry.path, generation)
            if entry.path in seen:  # two entries for one file: which size and digest is true?
                raise invalid(f"lists {entry.path} twice")
            seen.add(entry.path)
        if manifest.data_dir:
            _check_listed_path(manifest.data_dir, generation)
        if manifest.format_version < INCREMENTAL_FORMAT_VERSION and manifest.objects:
            raise invalid(f"has format {manifest.format_version} but lists shared objects "
                          f"(format {INCREMENTAL_FORMAT_VERSION} and later)")
        return manifest

    def file(self, path: str) -> FileEntry | None:
        return next((f for f in self.files if f.path == path), None)

    def identity(self) -> str:
        """sha256 of what makes this the same save in every tier: the manifest without the
        fields a tier rewrites when it holds a copy (``data_dir``). Two tiers' copies of a
        generation are interchangeable file for file only when their identities are equal
        (a re-save of the same update number is not)."""
        fields = self.model_dump_json(exclude={"data_dir"}, exclude_none=True)
        return hashlib.sha256(fields.encode("utf-8")).hexdigest()


class LatestPointer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # a generation name, never a path: readers join it to the root
    generation: str = Field(pattern=r"^gen-[0-9]{12}$")
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    manifest_size: int = Field(ge=0)
    format_version: int
    next_update: int = Field(ge=0)

    @model_validator(mode="after")
    def _names_its_update(self) -> LatestPointer:
        # a pointer whose next_update is not its generation's could hold the pointer back forever
        if parse_generation(self.generation) != self.next_update:
            raise ValueError(f"next_update {self.next_update} is not the number of {self.generation}")
        return self

    @classmethod
    def for_manifest(cls, manifest: Manifest, raw: bytes) -> LatestPointer:
        return cls(generation=manifest.generation, manifest_sha256=hashlib.sha256(raw).hexdigest(),
                   manifest_size=len(raw), format_version=manifest.format_version,
                   next_update=manifest.next_update)


def read_latest_pointer(store: StoreReader) -> LatestPointer:
    """The ``latest.json`` under ``store``, parsed: the one reader of the pointer. It is a
    hint (restore never trusts it over validation), so each caller decides what a problem is
    worth; each case raises its own type, with a message naming the file:
    ``FileNotFoundError``: there is none;
    ``UnsafeFileError``: not a regular file reached without a link, or over
    ``MAX_POINTER_BYTES`` (refused unopened: a FIFO would block the reader);
    ``StorageError``: the store could not read it;
    ``UnsafeNameError``: it names something that is not a generation name (never followed);
    ``ValidationError``: its bytes are not a pointer (JSON or schema)."""
    where = store.url(LATEST_NAME)
    try:
        raw = read_bounded(store, LATEST_NAME, MAX_POINTER_BYTES)
    except FileNotFoundError:
        raise
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"{where}: {exc}", path=LATEST_NAME) from None
    except (OSError, StorageError) as exc:
        raise StorageError(f"cannot read {where}: {exc}") from exc
    try:
        return LatestPointer.model_validate_json(raw)
    except (ValueError, TypeError, RecursionError) as exc:
        first = exc.errors()[0] if isinstance(exc, PydanticValidationError) and exc.errors() else {}
        if first.get("loc") == ("generation",) and first.get("type") == "string_pattern_mismatch":
            raise UnsafeNameError(f"{where} names {_short(first.get('input'))}, which is not a "
                                  "generation name (never followed)", path=LATEST_NAME) from exc
        raise ValidationError(f"{where} is corrupt: {_parse_failure(exc)}", path=LATEST_NAME) from exc


def read_latest_name(store: StoreReader) -> str | None:
    """The generation ``latest.json`` names; None on any problem (for readers to whom the
    pointer is only a hint to show: a listing, a log line, an estimate)."""
    try:
        return read_latest_pointer(store).generation
    except Exception:  # noqa: BLE001 - missing, unreadable or corrupt: no hint
        return None
