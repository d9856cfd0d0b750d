"""The common files of a node copy: what every node's copy of a generation holds besides its
own ranks' files.

DCP's ``.metadata`` and the global train state (``COMMON_FILES``) are written by rank 0 alone,
so only rank 0's node holds them in memory; a replay with node copies (node-local roots,
``replay/replayer.py``) would leave every other node's copy without them. Rank 0 offers their
bytes through the c10d store, the channel the replay already coordinates through; they are
small (metadata, not tensors), and above ``COMMON_BYTES_LIMIT`` in total nothing is offered
(logged): the other nodes' copies then hold the common files only where their own memory does.

Call order, in one sequence ``seq`` of a replay channel with node copies:

1. rank 0, after it published its copy and before it posts the outcome: :func:`offer` puts
   each common file's bytes under ``replay_common_key(channel, seq, G, path)``, then the offer
   (:class:`ReplayReport`: ``ok`` when the bytes are there, else why not) under
   ``replay_common_key(channel, seq, G)``;
2. the leader of every other node, after an ok outcome and before it publishes its copy:
   :func:`install` puts each common file into its pending copy, from its node's memory copy
   of G where that holds the file intact, else from the offered bytes. Either way the bytes
   are checked against the manifest (size and digest) before they are written; a file that
   no source holds intact is left out (logged), as before common files were offered;
3. rank 0, once every leader reported (or the deadline passed), or when it posted no ok
   outcome: :func:`withdraw` deletes the keys of step 1.
"""

from __future__ import annotations

import os

from .. import logs
from ..digests import digest_bytes
from ..errors import ValidationError
from ..format.manifest import COMMON_FILES, FileEntry, Manifest
from ..format.validate import check_entry
from ..protocol import messages
from ..protocol.comm import Comm
from ..protocol.messages import ReplayReport
from ..storage.local import open_regular, write_durable

log = logs.get(__name__)
COMMON_BYTES_LIMIT = 64 << 20  # the most common-file bytes one sequence puts in the c10d store


def common_entries(manifest: Manifest) -> list[FileEntry]:
    return [f for f in manifest.files if f.path in COMMON_FILES]


def offer(comm: Comm, channel: str, seq: int, manifest: Manifest, read, *,
          limit: int = COMMON_BYTES_LIMIT) -> list[str]:
    """Rank 0: put the common files' bytes (``read(path)``: rank 0's published copy) in the
    store; returns every key written, for :func:`withdraw`."""
    generation = manifest.generation
    entries = common_entries(manifest)
    total = sum(f.size for f in entries)
    keys: list[str] = []
    reason = None
    if total > limit:
        reason = (f"its common files are {total} bytes, over the {limit} bytes the c10d store "
                  "carries per generation")
    else:
        try:
            for entry in entries:
                key = messages.replay_common_key(channel, seq, generation, entry.path)
                comm.store_set(key, read(entry.path))
                keys.append(key)
        except Exception as exc:  # noqa: BLE001 - the other nodes fall back to their memory
            reason = f"cannot offer its common files: {type(exc).__name__}: {exc}"
    if reason is not None:
        log.warning("%s replay of %s: %s; other nodes' copies hold them only where their "
                    "memory does", channel, generation, reason)
    index = messages.replay_common_key(channel, seq, generation)
    messages.post(comm, index, ReplayReport(reason is None, reason))
    return [*keys, index]


def withdraw(comm: Comm, keys: list[str]) -> None:
    """Rank 0: delete what :func:`offer` wrote."""
    for key in keys:
        try:
            comm.store.delete_key(key)
        except Exception:  # noqa: BLE001 - a leftover key costs store memory, never correctness
            log.warning("could not delete store key %s", key)


def install(comm: Comm, channel: str, seq: int, manifest: Manifest, source_dir: str,
            target_dir: str) -> list[str]:
    """A leader without rank 0: every common file into ``target_dir`` (this node's pending
    copy), verified; returns why each file left out is missing (empty: all there)."""
    generation = manifest.generation
    offered: ReplayReport | None = None
    missing: list[str] = []
    for entry in common_entries(manifest):
        target = os.path.join(target_dir, entry.path)
        local = _read_local(os.path.join(source_dir, entry.path), entry)
        problem = None
        if local is not None:
            problem = _install(generation, entry, local, target)
            if problem is None:
                continue
        if offered is None:
            offered = _read_offer(comm, channel, seq, generation)
        if not offered.ok:
            missing.append(f"{entry.path}: {problem or 'not in this node memory'}; rank 0 offered "
                           f"none ({offered.error})")
            continue
        key = messages.replay_common_key(channel, seq, generation, entry.path)
        if comm.store_wait([key], 0.0):  # withdrawn: this leader is past rank 0's deadline
            missing.append(f"{entry.path}: the offer was withdrawn")
            continue
        problem = _install(generation, entry, comm.store_get(key), target)
        if problem is not None:
            missing.append(f"{entry.path}: the offered bytes: {problem}")
    if missing:
        log.warning("%s replay: this node's copy of %s lacks common files: %s", channel,
                    generation, "; ".join(missing))
    return missing


def _read_offer(comm: Comm, channel: str, seq: int, generation: str) -> ReplayReport:
    key = messages.replay_common_key(channel, seq, generation)
    if comm.store_wait([key], 0.0):  # rank 0 offers before it posts the outcome: never late
        return ReplayReport(False, "no offer in the store")
    return messages.decode(ReplayReport, comm.store_get(key))


def _read_local(path: str, entry: FileEntry) -> bytes | None:
    """This node's memory copy of a common file, when it has one of the listed size."""
    try:
        with open_regular(path) as handle:
            if os.fstat(handle.fileno()).st_size != entry.size:
                return None
            return handle.read()
    except OSError:
        return None


def _install(generation: str, entry: FileEntry, data: bytes, target: str) -> str | None:
    """Write ``data`` to ``target`` only if it matches ``entry``; else why not."""
    try:
        check_entry(generation, entry.path, entry, len(data), digest_bytes(data, entry.algorithm))
    except ValidationError as exc:
        return str(exc)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    write_durable(target, data)
    return None
