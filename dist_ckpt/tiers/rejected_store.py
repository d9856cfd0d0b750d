"""Moving a rejected generation aside on a store without rename, never deleting its bytes.

The entry is the one a POSIX root gets by a rename (``dist_ckpt.tiers.rejected``):
``ROOT/rejected/<generation>-<UTC time>-<id>/`` with a ``reason.txt``. ``mark_and_move``
builds it by copying, in steps that each survive a crash of the mover:

1. ``G/rejected-<sha256 of G's manifest>.json`` is created with a conditional create (one
   marker per manifest; a second mover reads the first one's). From here every reader treats
   that manifest as rejected (``dist_ckpt.format.validate.read_manifest``): G is never
   selected again, whatever happens next;
2. the manifest and the objects it references are copied to ``ROOT/rejected/<entry>/`` (the
   entry named in the marker, so a repeated copy lands in the same place), then ``reason.txt``;
3. ``G/manifest.json`` is deleted only while it still holds the rejected bytes (a delete
   conditional on its entity tag): a manifest saved again at G's update since is never
   deleted. From here G's update can be saved again;
4. the rejected manifest's data objects, then the marker, are deleted (attempt directories
   are unique per attempt: a new save's objects are never among them).

A mover cut short after any step leaves G rejected and is finished by the next one: a restore
that rejects G again, ``dist-ckpt quarantine``, or a save of G's update that finds the
rejected manifest still there (``finish_marked``).

Who calls it and when: ``ObjectStoreTier.move_aside`` (from ``dist_ckpt.restore.quarantine`` on
rank 0, and ``dist-ckpt quarantine``); ``finish_marked``: the tier's publish, on rank 0.
``put_back`` is the way back (``dist-ckpt unquarantine``), in restartable steps of its own.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticValidationError

from .. import faults, logs
from ..errors import GenerationExists, ValidationError
from ..format.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    REASON_NAME,
    REJECTED_DIR,
    REJECTED_MARKER_PREFIX,
    Manifest,
    RejectedEntry,
    parse_generation,
    rejected_entry_name,
    rejected_generation,
    rejected_marker_name,
)
from ..format.quarantine import EntryView, StagedView
from ..format.validate import Problem, check_sizes, check_structure
from ..storage.base import StoreReader, read_bounded
from ..storage.objectstore import ObjectStore

log = logs.get(__name__)
MAX_MARKER_BYTES = 64 << 10


class Marker(BaseModel):
    """``G/rejected-<manifest sha256>.json``: what is being moved, and where to."""

    model_config = ConfigDict(extra="forbid")
    generation: str
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    entry: str  # below REJECTED_DIR
    # where the rejected manifest's objects live inside G; None: the manifest does not parse,
    # its objects are not known (they stay for retention, which removes unreferenced ones)
    data_dir: str | None
    reason: str
    time: float


def mark_and_move(store: ObjectStore, problem: Problem) -> str | None:
    """Move generation ``problem.generation`` of ``store`` aside (the steps above); returns the
    entry's URL, or None when G holds neither a manifest nor a marker (nothing committed)."""
    generation = problem.generation
    if parse_generation(generation) is None:
        return None
    try:
        raw, tag = store.read_tagged(f"{generation}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    except FileNotFoundError:  # nothing committed here, or a move cut short after step 3
        return _finish_unlisted(store, generation)
    marker = _mark(store, generation, raw, f"{problem}")
    faults.hit("quarantine.marked", 0)
    return _move(store, marker, tag)


def finish_marked(store: ObjectStore, generation: str) -> bool:
    """Finish a move of ``generation`` cut short while its rejected manifest is still in place
    (a save of its update found the manifest); returns whether it did (the save retries)."""
    try:
        raw, tag = store.read_tagged(f"{generation}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return False
    marker = _read_marker(store, generation, rejected_marker_name(hashlib.sha256(raw).hexdigest()))
    if marker is None:
        return False
    log.warning("finishing the move aside of rejected generation %s before saving it again",
                generation)
    _move(store, marker, tag)
    return True


def _move(store: ObjectStore, marker: Marker, tag: str | None) -> str:
    generation = marker.generation
    target = f"{REJECTED_DIR}/{marker.entry}"
    _copy_aside(store, marker, target)
    faults.hit("quarantine.copied", 0)
    if not store.remove_if_tagged(f"{generation}/{MANIFEST_NAME}", tag):
        log.info("%s/%s no longer holds the rejected manifest (removed by another mover, or "
                 "saved again): left alone", generation, MANIFEST_NAME)
    faults.hit("quarantine.unlisted", 0)
    _clean(store, marker)
    _finish_unlisted(store, generation)  # markers of earlier rejected manifests of G
    log.warning("moved rejected generation %s aside to %s", generation, store.url(target))
    return store.url(target)


def _mark(store: ObjectStore, generation: str, raw: bytes, reason: str) -> Marker:
    """Step 1: create the marker of this manifest, or read the one an earlier mover created."""
    sha = hashlib.sha256(raw).hexdigest()
    name = rejected_marker_name(sha)
    try:
        data_dir: str | None = Manifest.from_bytes(raw, generation=generation).data_dir
    except ValidationError:
        data_dir = None
    marker = Marker(generation=generation, manifest_sha256=sha, entry=rejected_entry_name(generation),
                    data_dir=data_dir, reason=reason, time=time.time())
    while True:
        try:
            store.create_exclusive(f"{generation}/{name}", marker.model_dump_json().encode("utf-8"))
            return marker
        except FileExistsError:
            pass
        found = _read_marker(store, generation, name)
        if found is not None:
            return found
        # removed between the create and the read: a mover that finished meanwhile took the
        # manifest away, so ours finds it gone at its conditional delete (nothing is lost)


def _read_marker(store: ObjectStore, generation: str, name: str) -> Marker | None:
    """The marker ``G/name``, None when absent; ``ValidationError`` when it is not one of ours."""
    rel = f"{generation}/{name}"
    try:
        marker = Marker.model_validate_json(read_bounded(store, rel, MAX_MARKER_BYTES))
    except FileNotFoundError:
        return None
    except PydanticValidationError as exc:
        raise ValidationError(f"{store.url(rel)} is not a rejection marker", generation=generation,
                              path=name) from exc
    if marker.generation != generation or rejected_generation(marker.entry) != generation \
            or name != rejected_marker_name(marker.manifest_sha256) \
            or marker.data_dir is not None and not _safe_child(marker.data_dir):
        raise ValidationError(f"{store.url(rel)} names another generation or an unsafe path",
                              generation=generation, path=name)
    return marker


def _safe_child(data_dir: str) -> bool:
    return data_dir == "" or ("/" not in data_dir and data_dir not in (".", "..")
                              and not data_dir.startswith(REJECTED_MARKER_PREFIX)
                              and data_dir != MANIFEST_NAME)


def _copy_aside(store: ObjectStore, marker: Marker, target: str) -> None:
    """Step 2: the manifest and the rejected manifest's objects (every object of G but the
    markers when they are unknown), then the reason, below ``target``."""
    generation = marker.generation
    if marker.data_dir:
        names = [MANIFEST_NAME] + [rel.removeprefix(f"{generation}/")
                                   for rel in store.find(f"{generation}/{marker.data_dir}")]
    else:
        names = [rel.removeprefix(f"{generation}/") for rel in store.find(generation)]
        names = [n for n in names if not n.startswith(REJECTED_MARKER_PREFIX)]
    for name in names:
        try:
            store.copy(f"{generation}/{name}", f"{target}/{name}")
        except FileNotFoundError:  # a missing object may be why it was rejected
            continue
    store.put_bytes(f"{target}/{REASON_NAME}", f"{marker.reason}\n".encode())


def _clean(store: ObjectStore, marker: Marker) -> None:
    """Step 4: the rejected manifest's data objects (left when unknown), then its marker."""
    if marker.data_dir:
        store.remove_tree(f"{marker.generation}/{marker.data_dir}")
    faults.hit("quarantine.cleaned", 0)
    store.remove_tree(f"{marker.generation}/{rejected_marker_name(marker.manifest_sha256)}")


def _finish_unlisted(store: ObjectStore, generation: str) -> str | None:
    """Step 4 for every marker of G whose manifest is gone or replaced (moves cut short after
    step 3); returns the entry of the last one, None when there was none."""
    current = None
    try:
        raw = read_bounded(store, f"{generation}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
        current = rejected_marker_name(hashlib.sha256(raw).hexdigest())
    except FileNotFoundError:
        pass
    moved = None
    for name in store.listdir(generation):
        if not name.startswith(REJECTED_MARKER_PREFIX) or name == current:
            continue
        marker = _read_marker(store, generation, name)
        if marker is not None:
            _clean(store, marker)
            moved = store.url(f"{REJECTED_DIR}/{marker.entry}")
    return moved


def put_back(store: ObjectStore, entry: RejectedEntry, check: Callable[[StoreReader], Any]) -> str:
    """Make quarantined generation ``entry`` committed at ``G`` again, the steps of a publish:

    1. refuse (``GenerationExists``) while ``G/manifest.json`` exists; ``check`` the entry in
       place; finish the last step of every earlier move of G cut short
       (``_finish_unlisted``): it would delete what is copied next;
    2. copy every object of the entry but its manifest and ``reason.txt`` to the same name
       below G (the manifest's ``data_dir`` is the attempt it was saved in: no save of
       another attempt writes there);
    3. check the copy's structure and sizes, read with the entry's manifest (``StagedView``);
    4. create ``G/manifest.json`` with the entry's bytes, conditionally: the commit point (a
       generation saved meanwhile wins: ``GenerationExists``, the copy is an orphan attempt
       that retention removes);
    5. delete the entry.

    Cut short before step 4, G holds an attempt no manifest references: running it again copies
    again and goes on. After step 4, the entry is left: ``dist-ckpt rm --quarantined`` removes
    it. Returns G's URL."""
    generation = entry.generation
    manifest_rel = f"{generation}/{MANIFEST_NAME}"
    if store.exists(manifest_rel):
        raise GenerationExists(f"{generation} already exists under {store.root}")
    check(EntryView(store, entry))
    _finish_unlisted(store, generation)
    raw = read_bounded(store, f"{entry.path}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
    for rel in store.find(entry.path):
        name = rel.removeprefix(f"{entry.path}/")
        if name not in (MANIFEST_NAME, REASON_NAME):
            store.copy(rel, f"{generation}/{name}")
    staged = StagedView(store, entry)
    check_sizes(staged, generation, check_structure(staged, generation))
    try:
        store.create_exclusive(manifest_rel, raw)
    except FileExistsError as exc:
        raise GenerationExists(f"{generation} was saved under {store.root} meanwhile") from exc
    store.remove_tree(entry.path)
    log.info("put quarantined %s back as %s", store.url(entry.path), store.url(generation))
    return store.url(generation)
