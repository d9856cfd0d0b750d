"""What the first save under a cached plan fixed, kept so later saves do not resend it.

Under one cached DCP plan every save of a rank writes the same items into the same files at
the same offsets, so its DCP write results (about 200 bytes per item, the bulk of a report)
repeat byte for byte, and so does rank 0's ``.metadata`` built from everyone's. A rank sends
its results only when they differ from those of the last generation it saw committed; rank 0
keeps the results of the last two committed generations by digest and the ``.metadata``
bytes by the digest of all of them.

Call order (inside ``run_save``): every rank ``outgoing`` before reporting and ``committed``
once its outcome says committed; rank 0 ``resolve`` for each report, ``metadata`` /
``keep_metadata`` around ``.metadata``, and ``remember`` after the commit. A digest rank 0
does not hold fails that rank's part of the generation, and the rank then sends in full.
"""

from __future__ import annotations

import base64
import hashlib
import threading


class WriteResultsCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # saves in flight run on their own threads
        self._sent: str | None = None  # this rank: the digest of the last committed results
        self._kept: list[dict[str, bytes]] = []  # rank 0: digest -> results, last two commits
        # rank 0: (digest of all results, the plan's metadata object, the .metadata bytes)
        self._metadata: tuple[str, object, bytes] | None = None

    # ---- every rank -------------------------------------------------------------------
    def outgoing(self, results: bytes) -> tuple[str, str]:
        """(base64 results or "" when rank 0 holds them, their sha256)."""
        digest = hashlib.sha256(results).hexdigest()
        with self._lock:
            known = digest == self._sent
        return ("" if known else base64.b64encode(results).decode("ascii")), digest

    def committed(self, digest: str) -> None:
        with self._lock:
            self._sent = digest

    # ---- rank 0 -----------------------------------------------------------------------
    def resolve(self, encoded: str, digest: str) -> bytes | None:
        """A report's results: decoded, or from the kept generations; None when not kept."""
        if encoded:
            return base64.b64decode(encoded)
        with self._lock:
            return next((kept[digest] for kept in reversed(self._kept) if digest in kept), None)

    def remember(self, results: dict[str, bytes]) -> None:
        """The results (by digest) of a generation rank 0 committed."""
        with self._lock:
            self._kept = [*self._kept[-1:], results]

    def metadata(self, key: str, plan_metadata: object) -> bytes | None:
        """The ``.metadata`` bytes written for the same results under the same plan."""
        with self._lock:
            kept = self._metadata
        return kept[2] if kept is not None and kept[0] == key and kept[1] is plan_metadata else None

    def keep_metadata(self, key: str, plan_metadata: object, data: bytes) -> None:
        with self._lock:
            self._metadata = (key, plan_metadata, data)

    def clear(self) -> None:
        with self._lock:
            self._sent, self._kept, self._metadata = None, [], None
