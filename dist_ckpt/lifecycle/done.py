"""The DONE record: proof that a run finished, bound to what it finished with.

``CheckpointManager.finish()`` commits a last generation and then writes ``ROOT/DONE.json``
(atomic, durable). The record binds the run's contract digest, the final generation's name
and manifest digest, and the tokens seen. A reader accepts it only when the contract digest is
the current run's and the final generation still validates, so a DONE left behind by another
run (or pointing at a generation that was since damaged) never ends a new one.

Who writes: the leader of each filesystem group (so every node of a node-local setup has its
own copy), or rank 0 alone for an object-store root. Who reads: the launcher, after a start.
"""

from __future__ import annotations

import hashlib
import time

from pydantic import BaseModel, ConfigDict

from ..errors import DistCkptError, StorageError, ValidationError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.validate import check_sizes, check_structure
from ..storage.base import Store

DONE_NAME = "DONE.json"
DONE_FORMAT = 1


class DoneRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_version: int = DONE_FORMAT
    run_id: str | None = None
    generation: str
    next_update: int
    manifest_sha256: str
    contract_digest: str
    tokens_seen: int
    world_size: int
    finished_unix: float
    dist_ckpt_version: str


def record_for(manifest: Manifest, manifest_raw: bytes, *, run_id: str | None,
               version: str) -> DoneRecord:
    return DoneRecord(run_id=run_id, generation=manifest.generation,
                      next_update=manifest.next_update,
                      manifest_sha256=hashlib.sha256(manifest_raw).hexdigest(),
                      contract_digest=manifest.contract_digest, tokens_seen=manifest.tokens_seen,
                      world_size=manifest.world_size, finished_unix=time.time(),
                      dist_ckpt_version=version)


def write_done(store: Store, record: DoneRecord) -> None:
    store.put_bytes(DONE_NAME, record.model_dump_json(indent=1).encode("utf-8"))


def read_done(store: Store) -> DoneRecord | None:
    """The DONE record under the root, None when there is none; a corrupt one raises."""
    try:
        raw = store.read_bytes(DONE_NAME)
    except (FileNotFoundError, StorageError):
        return None
    try:
        return DoneRecord.model_validate_json(raw)
    except ValueError as exc:
        raise ValidationError(f"{DONE_NAME} is corrupt: {exc}", path=DONE_NAME) from exc


def check_done(store: Store, *, contract_digest: str | None,
               mirror: Store | None = None) -> tuple[DoneRecord | None, str]:
    """``(record, "")`` for a DONE that holds for this run, else ``(None, why not)``.

    The final generation must be committed here with exactly the recorded manifest; its files
    must be complete here or, for a node-local copy that holds only this node's shards, in the
    mirror (a committed copy of the same generation and contract)."""
    try:
        record = read_done(store)
    except ValidationError as exc:
        return None, str(exc)
    if record is None:
        return None, f"no {DONE_NAME}"
    if contract_digest is not None and record.contract_digest != contract_digest:
        return None, (f"stale {DONE_NAME}: contract {record.contract_digest[:19]} is not this "
                      f"run's {contract_digest[:19]}")
    name = record.generation
    try:
        raw = store.read_bytes(f"{name}/{MANIFEST_NAME}")
        if hashlib.sha256(raw).hexdigest() != record.manifest_sha256:
            return None, f"{DONE_NAME} names {name}, whose manifest has changed"
        manifest = check_structure(store, name)
    except (OSError, DistCkptError) as exc:
        return None, f"{DONE_NAME} names {name}, which does not validate: {exc}"
    try:
        check_sizes(store, name, manifest)
        return record, ""
    except (OSError, DistCkptError) as exc:
        local_problem = str(exc)
    if mirror is not None:
        try:
            remote = check_structure(mirror, name)
            check_sizes(mirror, name, remote)
            if remote.contract_digest == manifest.contract_digest:
                return record, ""
        except (OSError, DistCkptError) as exc:
            local_problem += f"; mirror: {exc}"
    return None, f"{DONE_NAME} names {name}, which is incomplete: {local_problem}"
