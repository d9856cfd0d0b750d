"""The job's one replay thread per rank: into the mirror, or (memory tier) into the root.

Call order: :func:`open_replayer` on every rank at the manager's construction, once the
filesystem groups are known (the replay announces per sequence number to every rank). The two
are exclusive (``CheckpointConfig`` rejects ``memory_tier`` with ``mirror``).
"""

from __future__ import annotations

from ..context import Context
from ..memory.runner import MemoryTierRunner
from ..save.replay import Replayer
from .pruning import Pruner


def open_replayer(ctx: Context, memory: MemoryTierRunner | None, pruner: Pruner) -> Replayer | None:
    config = ctx.config
    if memory is not None:
        replayer = memory.start_persisting(ctx.comm)
    elif ctx.tiers.mirror is not None:
        replayer = Replayer(
            ctx.comm, ctx.tiers.root, ctx.tiers.mirror, queue_length=config.mirror_queue,
            timeout_s=config.mirror_timeout_s, signing_key=config.signing_key,
            prune_destination=pruner.prune_destination if config.mirror_keep_last else None,
            nice=config.background_nice)
        if ctx.is_root_rank and config.keep_last:
            replayer.on_settled = pruner.submit
    else:
        return None
    pruner.replayer = replayer
    return replayer
