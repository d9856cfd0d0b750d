"""Managers still open when the interpreter exits are closed before its finalisation.

Call order: ``CheckpointManager.__init__`` calls ``hold`` (every rank); ``close`` calls
``release``; at interpreter exit ``atexit`` closes what is still held, so that no save thread
runs native code while the interpreter tears down (a crash, not an exit).
"""

from __future__ import annotations

import atexit
from typing import Protocol

from .. import logs

log = logs.get("dist_ckpt.manager")


class Closable(Protocol):
    def close(self) -> None: ...


# Strong references: a manager the job dropped without close() still owns running threads
# (nothing else refers to it: the save threads hold only their jobs), and must still be
# closed here rather than vanish from a weak set.
_OPEN: set[Closable] = set()


def hold(manager: Closable) -> None:
    _OPEN.add(manager)


def release(manager: Closable) -> None:
    _OPEN.discard(manager)


@atexit.register
def _close_at_exit() -> None:
    for manager in list(_OPEN):
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - an unraised save failure: logged, the exit goes on
            log.exception("closing a CheckpointManager at interpreter exit")
