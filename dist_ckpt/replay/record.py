"""A replay channel's record beside its source: the last generation it completed, those it
skipped, those that failed.

Rank 0's replay thread rewrites the record (atomically) after each generation it completed,
skipped or failed; ``finish()`` reads each channel's (DONE only once every channel completed
the final generation), the CLI the mirror's (``dist-ckpt ls``, ``inspect``). Each channel has
its own file under its source's root (``replay/channels.py``):

- ``mirror`` (root -> mirror): ``ROOT/mirror.json``, the mirror's URL under ``"mirror"``;
- ``persist`` (memory -> root): ``persist.json`` in the memory directory, the root's URL under
  ``"root"``. The persist channel used to write its record as ``mirror.json`` there; that
  file is still read where ``persist.json`` is absent.

Fields besides the destination: ``last_completed`` (a generation), ``last_completed_update``,
``completed_unix``, ``skipped`` and ``failed`` (the last 100 names each), ``last_failure``
(``generation``, ``reason``). An enqueued, half-copied or partly published generation is never
recorded as completed.
"""

from __future__ import annotations

import json
import os
import time

from ..errors import StorageError
from ..format.manifest import Manifest
from ..storage.base import StoreReader, open_store
from ..storage.local import atomic_write
from .channels import channel

LEGACY_PERSIST_RECORD = "mirror.json"  # the persist channel's record before it had its own name
KEPT_NAMES = 100  # skipped and failed generations a record lists (the newest)


def _read_json(store: StoreReader, name: str) -> dict | None:
    try:
        return json.loads(store.read_bytes(name))
    except (FileNotFoundError, StorageError, ValueError):
        return None


def read_record(source: str | StoreReader, channel_name: str) -> dict:
    """The record ``channel_name`` keeps under ``source`` (a root's URL or store); empty where
    there is none (or it is unreadable)."""
    store = open_store(source) if isinstance(source, str) else source
    spec = channel(channel_name)
    record = _read_json(store, spec.record)
    if record is None and channel_name == "persist":
        record = _read_json(store, LEGACY_PERSIST_RECORD)
        if record is not None and "mirror" in record:  # the legacy name of the destination key
            record[spec.destination] = record.pop("mirror")
    return record if isinstance(record, dict) else {}


def read_mirror_state(root: str | StoreReader) -> dict:
    """The mirror's record under a local root (``mirror.json``): uploads completed, skipped,
    failed; empty where there is none."""
    return read_record(root, "mirror")


def update_record(store: StoreReader, local_root: str, channel_name: str, destination: str, *,
                  completed: Manifest | None = None, skipped: str | None = None,
                  failed: str | None = None, reason: str | None = None) -> None:
    """Rank 0's replay thread: one generation completed, skipped or failed, written into the
    record under the source (``store`` reads it, ``local_root`` is its directory)."""
    spec = channel(channel_name)
    record = read_record(store, channel_name)
    record[spec.destination] = destination
    if completed is not None:
        record["last_completed"] = completed.generation
        record["last_completed_update"] = completed.next_update
        record["completed_unix"] = time.time()
    for key, name in (("skipped", skipped), ("failed", failed)):
        if name is not None:
            record[key] = (record.get(key, []) + [name])[-KEPT_NAMES:]
    if failed is not None:
        record["last_failure"] = {"generation": failed, "reason": reason}
    atomic_write(os.path.join(local_root, spec.record), json.dumps(record, indent=1).encode())
