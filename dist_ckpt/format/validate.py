"""Validation of a generation: structure, then sizes, then digests against its manifest.

A generation is trusted only if its manifest parses, names only safe relative paths, lists
the files every component needs, and every listed file has the recorded size (and, for the
integrity level, the recorded digest). Nothing here deserialises a pickle.

Nothing is opened before the store's ``checked_size`` found it a regular file reached without
links (``regular_file_size``): a FIFO would block its reader forever, a symbolic link (or a
device behind one) could leave the root or never end. Small files are read only when under
their bound.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import progress
from ..digests import digest_bytes
from ..errors import (
    SignatureError,
    StorageError,
    UncommittedGeneration,
    UnsafeFileError,
    ValidationError,
)
from ..storage.base import Store, StoreReader
from .manifest import (
    GLOBAL_STATE_FILE,
    LATEST_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    METADATA_FILE,
    PENDING_PREFIX,
    FileEntry,
    LatestPointer,
    Manifest,
    check_generation_name,
    is_object_path,
    parse_generation,
    rank_state_file,
    read_latest_name,
    read_latest_pointer,
    regular_file_size,
    rejected_marker_name,
)
from .signing import MAX_SIGNATURE_BYTES, SIGNATURE_NAME, verify


@dataclass
class Problem:
    generation: str
    reason: str
    path: str | None = None
    tier: str | None = None  # the root (local or mirror) the generation was read from
    signature: bool = False  # rejected by the signing key (not by its bytes)
    committed: bool = True  # False: it had no manifest that counts (``UncommittedGeneration``)

    def __str__(self) -> str:
        where = f" ({self.path})" if self.path else ""
        tier = f" [{self.tier}]" if self.tier else ""
        return f"{self.generation}{where}{tier}: {self.reason}"


def list_generations(store: StoreReader) -> list[str]:
    """Generation directory names, newest first by parsed update number (never lexically)."""
    names = [n for n in store.listdir("") if parse_generation(n) is not None]
    return sorted(names, key=lambda n: parse_generation(n) or 0, reverse=True)


def list_pending(store: StoreReader) -> list[str]:
    """Pending attempt directories, for display: bytes of a name that are not UTF-8 (which
    the library never writes) are shown as ``\\xNN``, so that the name can be printed."""
    return [_printable(n) for n in store.listdir("") if n.startswith(PENDING_PREFIX)]


def _printable(name: str) -> str:
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        pass
    try:  # os.listdir decodes bytes that are not UTF-8 as lone surrogates
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def read_manifest(store: StoreReader, generation: str, *, key: bytes | None = None) -> Manifest:
    """Parse a generation's manifest; with ``key``, only if its signature verifies. A manifest
    that a rejection marker names (a move aside under way on an object store) is rejected."""
    check_generation_name(generation)
    rel = f"{generation}/{MANIFEST_NAME}"
    try:
        regular_file_size(store, rel, generation=generation, path=MANIFEST_NAME,
                          limit=MAX_MANIFEST_BYTES)
        raw = store.read_bytes(rel)
    except (FileNotFoundError, StorageError) as exc:
        raise UncommittedGeneration(f"{generation} has no manifest (never committed)",
                              generation=generation, path=MANIFEST_NAME) from exc
    marker = rejected_marker_name(hashlib.sha256(raw).hexdigest())
    if store.exists(f"{generation}/{marker}"):
        raise UncommittedGeneration(f"{generation} was rejected and is being moved aside ({marker})",
                              generation=generation, path=marker)
    manifest = Manifest.from_bytes(raw, generation=generation)
    if key is not None:
        sig_rel = f"{generation}/{manifest.location(SIGNATURE_NAME)}"
        try:
            regular_file_size(store, sig_rel, generation=generation, path=SIGNATURE_NAME,
                              limit=MAX_SIGNATURE_BYTES)
            signature: bytes | None = store.read_bytes(sig_rel)
        except (FileNotFoundError, StorageError):
            signature = None
        except UnsafeFileError as exc:  # unreadable, as a signature: signature=True for restore
            raise SignatureError(str(exc), generation=generation, path=SIGNATURE_NAME) from exc
        verify(key, raw, signature, generation=generation)
    return manifest


def check_structure(store: StoreReader, generation: str, *, key: bytes | None = None) -> Manifest:
    manifest = read_manifest(store, generation, key=key)
    listed = {f.path for f in manifest.files}
    if manifest.world_size > len(listed):  # before building world_size names
        raise ValidationError(f"{generation}: {MANIFEST_NAME} says world_size={manifest.world_size} but "
                              f"lists {len(listed)} files: rank state files are missing",
                              generation=generation, path=MANIFEST_NAME)
    required = {METADATA_FILE, GLOBAL_STATE_FILE}
    required |= {rank_state_file(r) for r in range(manifest.world_size)}
    missing = sorted(required - listed)
    if missing:
        raise ValidationError(f"{generation} manifest lacks required file(s) {missing}",
                              generation=generation, path=missing[0])
    if parse_generation(generation) != manifest.next_update:
        raise ValidationError(f"{generation} manifest says next_update={manifest.next_update}",
                              generation=generation, path=MANIFEST_NAME)
    return manifest


def check_entry(generation: str, path: str, entry: FileEntry | None, size: int,
                digest: str | None = None) -> None:
    """The one comparison of a file's size (and, when given, its digest, computed with the
    entry's algorithm) with its manifest entry;
    raises ``ValidationError`` naming the file. Every reader of a listed file comes here."""
    if entry is None:
        raise ValidationError(f"{generation}: the manifest lists no {path}", generation=generation,
                              path=path)
    if size != entry.size:
        raise ValidationError(f"{generation}: file {path} does not match its manifest entry: "
                              f"{size} bytes, manifest says {entry.size}", generation=generation, path=path)
    if digest is not None and digest != entry.digest:
        raise ValidationError(f"{generation}: file {path} does not match its manifest entry: "
                              f"{entry.algorithm} {digest[:12]}..., manifest says {entry.digest[:12]}...",
                              generation=generation, path=path)


def check_sizes(store: StoreReader, generation: str, manifest: Manifest, *, concurrency: int = 1) -> None:
    """Every listed file is present with its size. ``concurrency`` > 1 asks that many at a
    time (an object store's HEADs: a generation of W ranks lists O(W) files)."""
    sound: set[str] = set()

    def check(entry: FileEntry) -> None:
        rel = manifest.where(entry.path)
        try:
            size = regular_file_size(store, rel, generation=generation, path=entry.path,
                                     checked_dirs=sound)
        except (FileNotFoundError, StorageError) as exc:
            raise ValidationError(f"{generation}: file {entry.path} is missing",
                                  generation=generation, path=entry.path) from exc
        check_entry(generation, entry.path, entry, size)

    if concurrency <= 1 or len(manifest.files) <= 1:
        for entry in manifest.files:
            check(entry)
        return
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dist-ckpt-sizes") as pool:
        for _ in pool.map(check, manifest.files):  # the first failure raises, in file order
            pass


class ObjectVerdicts:
    """The shared objects (``objects/<name>``) one caller already hashed, for validating
    several generations of one store that reference the same objects (``dist-ckpt verify
    --all``): each object is hashed once, and a damaged one fails every generation that
    lists it with the same reason, without being read again.

    A verdict belongs to a manifest entry (path, size, algorithm, digest), so two manifests
    that list one path with different entries each get their own. Create one per pass over a
    store, on one process, and drop it after: an object replaced meanwhile is not seen again.
    """

    def __init__(self) -> None:
        # entry key -> None (matches) or why it does not ("is missing", "does not match ...")
        self.verdicts: dict[tuple[str, int, str, str], str | None] = {}
        self.unsafe: set[tuple[str, int, str, str]] = set()  # refused unopened: UnsafeFileError
        self.hashed = 0  # objects read and hashed (each at most once)
        self.reused = 0  # checks answered from a verdict already reached

    @staticmethod
    def key(entry: FileEntry) -> tuple[str, int, str, str]:
        return entry.path, entry.size, entry.algorithm, entry.digest

    def damaged(self) -> dict[str, str]:
        """Object path -> why it failed, for every object found damaged."""
        return {key[0]: reason for key, reason in self.verdicts.items() if reason is not None}

    def check(self, store: StoreReader, generation: str, entry: FileEntry,
              sound: set[str] | None = None) -> None:
        """Raise ``ValidationError`` naming ``generation`` and the object when the object does
        not match ``entry``; hash it only the first time it is asked about."""
        key = self.key(entry)
        if key in self.verdicts:
            self.reused += 1
        else:
            self.verdicts[key] = self._verdict(store, entry, sound)
        reason = self.verdicts[key]
        if reason is not None:  # the type check_digests raises for it, with this generation
            kind = UnsafeFileError if key in self.unsafe else ValidationError
            raise kind(f"{generation}: file {entry.path} {reason}", generation=generation,
                       path=entry.path)

    def _verdict(self, store: StoreReader, entry: FileEntry, sound: set[str] | None) -> str | None:
        try:
            size = store.checked_size(entry.path, sound_dirs=sound)  # as regular_file_size
            if size != entry.size:
                return f"does not match its manifest entry: {size} bytes, manifest says {entry.size}"
            self.hashed += 1
            digest = store.digest(entry.path, entry.algorithm)
        except UnsafeFileError as exc:
            self.unsafe.add(self.key(entry))
            return str(exc)  # "is a symbolic link, not a regular file (refused unopened)"
        except (FileNotFoundError, StorageError):
            return "is missing"
        progress.advance(entry.size)
        if digest != entry.digest:
            return (f"does not match its manifest entry: {entry.algorithm} {digest[:12]}..., "
                    f"manifest says {entry.digest[:12]}...")
        return None


def check_digests(store: StoreReader, generation: str, manifest: Manifest,
                  paths: Iterable[str] | None = None, *,
                  objects: ObjectVerdicts | None = None) -> None:
    """Hash the listed files (``paths``: only these) and compare each with its entry; raise
    ``ValidationError`` naming the first that differs. ``objects``: verdicts on shared
    objects already reached for other generations of this store (each hashed once)."""
    wanted = None if paths is None else set(paths)
    sound: set[str] = set()
    for entry in manifest.files:
        if wanted is not None and entry.path not in wanted:
            continue
        if objects is not None and is_object_path(entry.path):
            objects.check(store, generation, entry, sound)
            continue
        rel = manifest.where(entry.path)
        try:  # a missing file is named like a wrong one: restore repairs it from another tier
            regular_file_size(store, rel, generation=generation, path=entry.path, checked_dirs=sound)
            digest = store.digest(rel, entry.algorithm)
        except (FileNotFoundError, StorageError) as exc:
            raise ValidationError(f"{generation}: file {entry.path} is missing",
                                  generation=generation, path=entry.path) from exc
        progress.advance(entry.size)
        check_entry(generation, entry.path, entry, entry.size, digest)


def read_verified(store: StoreReader, generation: str, manifest: Manifest, path: str, *,
                  validated: bool = False) -> bytes:
    """A small listed file's bytes, returned only if they match its manifest entry: nothing
    parses bytes a digest has not vouched for. ``validated``: the generation was validated
    before, so a mismatch means the file changed since (the error says so)."""
    rel = manifest.where(path)
    entry = manifest.file(path)
    try:
        size = regular_file_size(store, rel, generation=generation, path=path)
        check_entry(generation, path, entry, size)  # before reading: never a file of the wrong size
        raw = store.read_bytes(rel)
        assert entry is not None
        check_entry(generation, path, entry, len(raw), digest_bytes(raw, entry.algorithm))
    except ValidationError as exc:
        if not validated:
            raise
        raise ValidationError(f"{exc} (changed after validation)", generation=generation,
                              path=path) from None
    return raw


def move_latest(store: Store, manifest: Manifest, raw: bytes, *, gone: str | None = None) -> None:
    """Point ``latest.json`` at ``manifest``'s generation unless it already points newer.
    The only writer of the pointer, in every tier; call after the generation validated.
    ``gone``: a generation just deleted or moved aside (:func:`repoint_latest`); a pointer
    that names it may move back to an older generation, and only then."""
    try:
        current: LatestPointer | None = read_latest_pointer(store)
    except (FileNotFoundError, StorageError, ValidationError):
        current = None  # missing, unreadable or not a pointer: replaced
    if current is not None and current.next_update > manifest.next_update \
            and current.generation != gone:
        return  # never back to an older generation
    pointer = LatestPointer.for_manifest(manifest, raw).model_dump_json().encode("utf-8")
    try:
        store.put_bytes(LATEST_NAME, pointer)
    except OSError as exc:
        raise StorageError(f"cannot replace {store.url(LATEST_NAME)}: {exc}") from exc


def repoint_latest(store: Store, gone: Collection[str], *, skip: Collection[str] = (),
                   digests: bool, key: bytes | None = None) -> str | None:
    """After the generations ``gone`` were deleted or moved aside: when ``latest.json`` names
    one of them, point it (:func:`move_latest`) at the newest remaining generation that
    validates (sizes, and digests with ``digests``), passing over ``skip`` (known rejected);
    with none left, remove the pointer, so that it never names what is not there. Returns the
    generation it names now; None when it was left alone or removed. One process at a time
    (rank 0 of a filesystem, or the operator's CLI)."""
    current = read_latest_name(store)
    if current is None or current not in gone:
        return None
    for name in list_generations(store):
        if name in gone or name in skip:
            continue
        try:
            validate(store, name, digests=digests, key=key)
            raw = store.read_bytes(f"{name}/{MANIFEST_NAME}")
            move_latest(store, Manifest.from_bytes(raw, generation=name), raw, gone=current)
        except (ValidationError, OSError):
            continue
        return name
    store.remove_tree(LATEST_NAME)
    return None


def validate(store: StoreReader, generation: str, *, digests: bool = True,
             key: bytes | None = None, objects: ObjectVerdicts | None = None) -> Manifest:
    """Full validation of one generation on one process; raises ``ValidationError``.
    ``objects``: shared-object verdicts kept across the generations of one pass
    (:class:`ObjectVerdicts`)."""
    manifest = check_structure(store, generation, key=key)
    check_sizes(store, generation, manifest)
    if digests:
        check_digests(store, generation, manifest, objects=objects)
    return manifest
