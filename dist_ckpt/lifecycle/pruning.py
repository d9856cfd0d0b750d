"""Retention passes a manager runs off the commit path.

Call order: ``prune_local`` runs in the manager's janitor thread on each filesystem leader
after each committed save (and on rank 0 after each mirror upload settles);
``prune_mirror`` runs in rank 0's mirror thread after each completed upload. A failure
deletes nothing and is logged: retention must never break training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import logs
from ..ops import retention
from ..protocol.messages import PINS_KEY
from ..restore import rehearse as rehearsal

if TYPE_CHECKING:
    from ..manager import CheckpointManager

log = logs.get(__name__)


def prune_local(mgr: CheckpointManager) -> None:
    """Local retention; generations still waiting for the mirror are kept (a corrupt
    pins.json, say, deletes nothing)."""
    if mgr.flash is not None:
        mgr.flash.replicate()  # first: the generation sent is never pruned meanwhile
        mgr.flash.prune_memory()  # the root is pruned after each persistence
        return
    if not mgr.config.keep_last:
        return
    try:
        _prune_local_now(mgr)
    except Exception:  # noqa: BLE001 - retention must never break training
        log.exception("local retention pass failed")


def _prune_local_now(mgr: CheckpointManager) -> None:
    config = mgr.config
    committed = [g.name for g in mgr.generations() if g.state == "committed"]
    if config.require_rehearsal and committed and not rehearsal.passed(mgr.backend, committed[0]):
        log.info("retention waits: %s has not passed a rehearsal (require_rehearsal)", committed[0])
        return
    pinned = frozenset(mgr.uploader.pending()) if mgr.uploader is not None else frozenset()
    pinned |= mgr.comm.read_names(PINS_KEY)
    retention.prune(mgr.tier, keep_last=config.keep_last, keep_every=config.keep_every,
                    pinned=pinned, key=config.signing_key, committed=committed)


def prune_mirror(mgr: CheckpointManager) -> None:
    """Rank 0's uploader, after each completed upload; pins live in the local root."""
    assert mgr.mirror_tier is not None
    retention.prune(mgr.mirror_tier, keep_last=mgr.config.mirror_keep_last,
                    keep_every=mgr.config.keep_every, key=mgr.config.signing_key,
                    pinned=frozenset(retention.read_pins(mgr.backend)))
