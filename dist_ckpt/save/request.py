"""One save attempt's inputs and its result on this rank (shared by the save modules)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..digests import DEFAULT_ALGORITHM
from ..errors import CommitError
from ..tiers.base import Attempt
from .planning import PreparedSave
from .reuse import ReuseDecision


@dataclass(frozen=True)
class ManifestInfo:
    """What rank 0 writes into the manifest besides the files (rank 0 only)."""

    world_size: int
    components: list[str]
    contract: dict[str, str]
    contract_digest: str
    dist_ckpt_version: str
    contract_values: dict[str, Any] | None = None  # canonical JSON of the contract's fields


@dataclass
class SaveRequest:
    generation: str
    next_update: int
    tokens_seen: int
    attempt: Attempt  # this rank's handle on the tier attempt (names it: attempt.attempt_id)
    prepared: PreparedSave
    rank_state: bytes
    global_state: bytes | None  # rank 0 only
    info: ManifestInfo | None  # rank 0 only
    signing_key: bytes | None = field(default=None, repr=False)  # HMAC key for manifest.sig
    started: float = field(default_factory=time.monotonic)
    digest_algorithm: str = DEFAULT_ALGORITHM  # of every file this save writes (manifest records it)
    staging_error: Exception | None = None  # a lazy copy that failed: nothing may be written
    reuse: ReuseDecision | None = None  # incremental: the frozen items referenced or written as objects

    @property
    def attempt_id(self) -> str:
        return self.attempt.attempt_id


@dataclass
class SaveJob:
    request: SaveRequest
    on_done: Callable[[SaveJob], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: CommitError | None = None
    thread: threading.Thread | None = None
    committed: bool = False
    duration_s: float = 0.0
    manifest_raw: bytes | None = None  # rank 0, and the leaders that publish a node copy
    manifest_sha256: str | None = None  # every rank, once committed (the outcome's)
    blocking_s: float = 0.0  # training time this save took on the calling thread
    store_keys: list[tuple[str, int]] = field(default_factory=list)  # (key set here, readers)
    written: bool = False
