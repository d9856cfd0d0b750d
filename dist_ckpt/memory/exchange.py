"""One node leader's part of a routed restore exchange (``memory/routes.py``).

Every leader walks the routes' transfers in their order and runs those it takes part in: a send
(``PeerChannel.send_file``) when it is the source, a receive when it is the destination.
Walking one order everywhere cannot deadlock: the first unfinished transfer always has both
its ends ready. A file that fails its check is refused and the walk goes on, so both ends stay
in step; only a transport failure (a peer gone, the group's deadline, which is the restore's)
ends this leader's walk.

Files for the node's memory copy go into the existing copy of the generation (new names only)
or into a new pending directory renamed into place manifest-last once every file arrived;
files its load reads only go to the fetched directory. Call order: every leader with
transfers, after rank 0's routes are broadcast, inside ``NodeRing.repair`` (collective).
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field

from .. import logs
from ..errors import ValidationError
from ..format.manifest import MANIFEST_NAME, FileEntry, Manifest, check_generation_name, pending_dir_name
from ..format.validate import check_entry
from ..storage.local import file_digest, fsync_dir, write_durable
from .peer import PeerChannel, PeerError
from .routes import ExchangeRoutes, Transfer

log = logs.get(__name__)


@dataclass
class Outcome:
    received: list[str] = field(default_factory=list)  # paths this leader received
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Places:
    """Where a leader's files live: its memory root, its replica root, its fetched root."""

    memory: str
    replica: str
    fetched: str


def run_exchange(routes: ExchangeRoutes, channel: PeerChannel, rank: int, places: Places) -> Outcome:
    """This leader's sends and receives of ``routes``, in their order."""
    check_generation_name(routes.generation)
    outcome = Outcome()
    mine = [t for t in routes.transfers if rank in (t.source, t.destination)]
    if not mine:
        return outcome
    manifest = Manifest.from_bytes(routes.manifest.encode(), generation=routes.generation)
    entries = {f.path: f for f in manifest.files}
    final = os.path.join(places.memory, routes.generation)
    exists = os.path.isdir(final)
    if exists and _manifest(final) != routes.manifest:  # received aside, then dropped
        outcome.failures.append(f"node of rank {rank}: {routes.generation} here has another manifest: "
                                "left as it is")
        exists = False
    pending = os.path.join(places.memory, pending_dir_name(routes.generation, uuid.uuid4().hex[:8]))
    target = final if exists else pending
    copied = 0
    for transfer in mine:
        entry = entries.get(transfer.path)
        into = os.path.join(places.fetched, routes.generation) if transfer.load_only else target
        if transfer.source == transfer.destination:  # from this node's own replica
            try:
                _copy_here(_local(places, transfer), os.path.join(into, transfer.path), routes.generation,
                           transfer.path, entry)
                outcome.received.append(transfer.path)
                copied += not transfer.load_only
            except (OSError, PeerError) as exc:
                outcome.failures.append(f"node of rank {rank}: {exc}")
            continue
        if transfer.source == rank:
            try:
                channel.send_file(transfer.destination, _local(places, transfer), entry)
            except PeerError as exc:  # the receiver was told: it reports the failure
                log.warning("%s", exc)
            except RuntimeError as exc:  # the transport: the walk cannot go on in step
                outcome.failures.append(f"node of rank {rank}: sending to rank {transfer.destination}: {exc}")
                break
            continue
        try:
            channel.receive_file(transfer.source, os.path.join(into, transfer.path), routes.generation,
                                 transfer.path, entry)
            outcome.received.append(transfer.path)
            copied += not transfer.load_only
        except PeerError as exc:
            outcome.failures.append(f"node of rank {rank}: {exc}")
        except RuntimeError as exc:
            outcome.failures.append(f"node of rank {rank}: receiving from rank {transfer.source}: {exc}")
            break
    _install(routes, places, target, exists, failed=bool(outcome.failures), copied=copied)
    return outcome


def _install(routes: ExchangeRoutes, places: Places, target: str, exists: bool, *,
             failed: bool, copied: int) -> None:
    """A new copy complete: its manifest last, then renamed into place; incomplete: gone."""
    if exists or not copied and not os.path.isdir(target):
        if exists:
            fsync_dir(target)
        return
    if failed:
        shutil.rmtree(target, ignore_errors=True)
        return
    write_durable(os.path.join(target, MANIFEST_NAME), routes.manifest.encode())
    fsync_dir(target)
    os.rename(target, os.path.join(places.memory, routes.generation))
    fsync_dir(places.memory)


def _local(places: Places, transfer: Transfer) -> str:
    root, _, directory = transfer.where.partition("/")
    return os.path.join(places.replica if root == "replica" else places.memory, directory, transfer.path)


def _copy_here(source: str, target: str, generation: str, name: str, entry: FileEntry | None) -> None:
    """A file of this node's replica into its memory copy, checked as a received one is."""
    if entry is None:
        raise PeerError(f"{name} of {generation} is not listed: not copied")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.part-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copyfile(source, partial)
        try:
            check_entry(generation, name, entry, *file_digest(partial, entry.algorithm))
        except ValidationError as exc:
            raise PeerError(f"{name} in this node's replica fails its digest: {exc}") from exc
        os.link(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _manifest(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, MANIFEST_NAME), encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None
