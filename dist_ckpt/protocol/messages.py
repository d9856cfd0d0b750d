"""Every message ranks exchange about a checkpoint, and every c10d store key they use.

Foreground (a collective on the checkpoint group):
- :class:`SaveFacts`: what each rank knows when ``save()`` is called (all-gathered).

Background (through the c10d store, never a collective; see docs/architecture.md):
- :class:`RankReport`: rank r -> its node leader -> rank 0 (``protocol/gather.py``, scope
  ``save_scope(generation, attempt_id)``: one key per node).
- :class:`CommitOutcome`: rank 0 -> the node leaders, ``outcome_key(generation, attempt_id)``
  (the commit point is claimed before under ``claim_key``: ``COMMITTING`` by rank 0, or
  ``ABANDONED`` by a leader that gave up first; only the verdict goes under the outcome key,
  so a leader's one blocking wait on it ends with the verdict), -> their
  nodes' ranks through the node directory (``outcome_relay``). The manifest itself goes only
  to the leaders that publish a node copy (``manifest_key``).
- node copy published: a filesystem leader -> its group, ``published_key(...)``.
- :class:`ReplayAnnouncement`: rank 0's replay thread -> every replay thread,
  ``replay_seq_key(channel, seq)``, then the job's bell (``protocol/node.py``).
- :class:`ReplayReport`: rank r's replay thread -> rank 0's, through its node leader
  (``protocol/gather.py``, scope ``replay_scope(channel, seq)``);
  with node copies (node-local roots) rank 0's publish -> the other nodes' leaders,
  ``replay_outcome_key(channel, seq)``, and each such leader's copy -> rank 0,
  ``replay_copy_key(channel, seq, leader)``; before the outcome rank 0 offers the common
  files' bytes to those leaders, ``replay_common_key(channel, seq, generation[, path])``.
A replay's keys are scoped by its channel (``persist``: memory -> root; ``mirror``: root ->
mirror), so the two replays of one job never read each other's sequence.
Keys a single reader consumes are deleted by that reader; keys read by several ranks are
acknowledged under ``ack_key(key)`` and deleted by their writer once all have read them.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from .comm import Comm

PINS_KEY = "pins"
PREEMPT_TARGET_KEY = "preempt/target"  # the update every rank saves before stopping
PREEMPT_ACK_KEY = "preempt/acks"  # how many ranks know the target
_STOP = "__stop__"

Message = TypeVar("Message", "RankReport", "CommitOutcome", "ReplayAnnouncement", "ReplayReport")


# ---- store keys ---------------------------------------------------------------------------
def save_scope(generation: str, attempt_id: str) -> str:
    """The scope of one save attempt's reports (``protocol/gather.py``)."""
    return f"{generation}/{attempt_id}"


def outcome_key(generation: str, attempt_id: str) -> str:
    return f"{generation}/{attempt_id}/outcome"


def claim_key(generation: str, attempt_id: str) -> str:
    """Who claimed the commit point first: rank 0 (``COMMITTING``) or a leader (``ABANDONED``)."""
    return f"{generation}/{attempt_id}/claim"


def manifest_key(generation: str, attempt_id: str) -> str:
    """The committed manifest's bytes, for the leaders that publish a node copy only."""
    return f"{generation}/{attempt_id}/manifest"


def outcome_relay(generation: str, attempt_id: str) -> str:
    """The outcome's file name in the node directory (``Node.relay_post``)."""
    return f"outcome-{generation}-{attempt_id}"


def published_key(generation: str, attempt_id: str, leader: int) -> str:
    return f"{generation}/{attempt_id}/published/{leader}"


def ack_key(key: str) -> str:
    return f"{key}/read"


def replay_seq_key(channel: str, seq: int) -> str:
    return f"replay/{channel}/seq/{seq}"


def replay_scope(channel: str, seq: int) -> str:
    """The scope of one replay's reports (``protocol/gather.py``)."""
    return f"replay/{channel}/{seq}"


def replay_outcome_key(channel: str, seq: int) -> str:
    return f"replay/{channel}/{seq}/outcome"


def replay_copy_key(channel: str, seq: int, leader: int) -> str:
    return f"replay/{channel}/{seq}/copy/{leader}"


def replay_common_key(channel: str, seq: int, generation: str, path: str | None = None) -> str:
    """Rank 0's offer of ``generation``'s common files to the other nodes' leaders; with
    ``path``, that file's bytes (``replay/common_files.py``)."""
    offer = f"replay/{channel}/{seq}/common/{generation}"
    return offer if path is None else f"{offer}/file/{path}"


def replay_pinned_key(channel: str) -> str:
    """The generations a channel's replay still has to copy (rank 0 -> every rank's retention)."""
    return f"replay/{channel}/pinned"


# ---- messages -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SpaceFacts:
    leader: int  # the filesystem group's leader, which measured ``free``
    bytes: int  # what this rank will write under the cached plan, saves in flight included
    free: int | None  # the leader's free bytes; None on other ranks or when unmeasurable


@dataclass(frozen=True)
class SaveFacts:
    """One rank's contribution to the all-gather at ``save()``; rank 0 adds ``exists`` and
    the new ``attempt_id``."""

    busy: bool  # this rank has max_in_flight saves in flight
    errors: tuple[str, ...]  # failed generations whose CommitError this rank has not raised
    boundary: bool  # at an optimizer boundary
    cached: bool  # this rank's cached save plan matches the live layout
    space: SpaceFacts | None
    extras: dict[str, str]  # digest per TrainState.extras key
    exists: str | None = None  # rank 0: why the generation cannot be saved, if it cannot
    attempt_id: str | None = None  # rank 0: names this save attempt everywhere


@dataclass(frozen=True)
class RankReport:
    rank: int
    files: list[dict] = field(default_factory=list)  # FileEntry fields
    # base64 of the pickled DCP write results; "" when they equal this rank's results in the
    # last generation it saw committed (rank 0 kept them: ``save/results_cache.py``)
    results: str = ""
    results_sha256: str = ""
    error: str | None = None


# the claim key's value once rank 0 publishes (it can no longer fail the generation), and the
# value a node leader that gave up waiting sets first (rank 0 then may not publish)
COMMITTING = b"committing"
ABANDONED = b"abandoned"


@dataclass(frozen=True)
class CommitOutcome:
    """Rank 0's verdict: a few hundred bytes whatever the world size (the manifest stays on
    the tier; a rank that needs it reads it there and checks it against ``manifest_sha256``)."""

    ok: bool
    failures: dict[str, str] = field(default_factory=dict)  # rank (as text) -> message
    generation: str = ""
    manifest_sha256: str | None = None


@dataclass(frozen=True)
class ReplayAnnouncement:
    """Rank 0's next generation to replay: its name and its manifest's digest (each rank
    reads the manifest from its own source tier and checks it)."""

    generation: str
    manifest_sha256: str = ""

    @property
    def stop(self) -> bool:
        return self.generation == _STOP

    @classmethod
    def stop_message(cls) -> ReplayAnnouncement:
        return cls(_STOP)


@dataclass(frozen=True)
class ReplayReport:
    ok: bool
    error: str | None = None


def encode(message: Any) -> bytes:
    return json.dumps(asdict(message)).encode("utf-8")


def decode(kind: type[Message], raw: bytes) -> Message:
    return kind(**json.loads(raw))


def post(comm: Comm, key: str, message: Any) -> None:
    comm.store_set(key, encode(message))


# ---- collection with a deadline -----------------------------------------------------------
@dataclass
class Collected:
    """What :func:`collect` found: the raw message of each rank that posted, and the ranks
    that did not before the deadline."""

    received: dict[int, bytes]
    missing: list[int]


def collect(comm: Comm, keys: dict[int, str], deadline: float, *, delete: bool = True) -> Collected:
    """Wait until every rank's key exists or ``deadline`` (``time.monotonic``) passes; read
    what arrived and, with ``delete``, delete the keys read (the caller is their only reader).
    Used by rank 0 for save reports and by rank 0's replay thread for replay reports."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        late = set(comm.store_wait(list(keys.values()), remaining))
    else:
        late = {k for k in keys.values() if not comm.store.check([k])}
    received = {rank: comm.store_get(key) for rank, key in keys.items() if key not in late}
    if delete:
        for rank in received:
            comm.store.delete_key(keys[rank])
    return Collected(received, sorted(rank for rank, key in keys.items() if key in late))
