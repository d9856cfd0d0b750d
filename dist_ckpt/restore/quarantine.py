"""Moving rejected generations out of the job's way at restore, never deleting them.

When restore rejects a generation newer than the one it loads (a damaged shard, or a
node-local copy whose other shards never reached the mirror before a crash), the job will
reach that update number again and must be able to save it: the tier moves it aside
(``CommitTier.move_aside``: a POSIX root renames it below ``ROOT/rejected/``, an object store
copies it there in restartable steps, ``dist_ckpt.tiers.rejected_store``).

Call order: after ``select_generation`` (whose rejections every rank agrees on), the leader of
each filesystem group moves its own copies (rank 0 alone on a shared tier, an object store);
then all ranks exchange what moved.
"""

from __future__ import annotations

from .. import logs
from ..errors import DistCkptError
from ..format.manifest import LATEST_NAME, parse_generation, read_latest_name
from ..format.validate import Problem, repoint_latest
from ..protocol.comm import Comm
from ..tiers.base import CommitTier

log = logs.get(__name__)


def blocking(rejected: list[Problem], chosen: str | None, tier_url: str) -> list[Problem]:
    """The rejections in ``tier_url`` that would block a later save: newer than ``chosen``,
    and rejected for their bytes (a signature under another key is not damage)."""
    floor = -1 if chosen is None else (parse_generation(chosen) or -1)
    return [p for p in rejected if p.tier == tier_url and not p.signature
            and (parse_generation(p.generation) or -1) > floor]


def move_blocking(comm: Comm, tier: CommitTier, rejected: list[Problem], chosen: str | None) -> list[str]:
    """All ranks: each filesystem leader (rank 0 on a shared tier) moves its copies of the
    blocking rejections aside; returns the moved generation names (agreed). A move that fails
    is logged, not raised: the save of that update number then fails with
    ``GenerationExists`` instead (unless the move got past its marker: the save finishes it)."""
    moving = blocking(rejected, chosen, tier.url)
    if not moving:  # the same agreed inputs on every rank: all skip the all-gather together
        return []
    moved: list[str] = []
    # one copy serves every rank on a shared tier: one mover, never one per filesystem group
    if comm.rank == (0 if tier.shared else comm.fs_leader):
        for problem in moving:
            try:
                if tier.move_aside(problem) is not None:
                    moved.append(problem.generation)
            except (OSError, DistCkptError) as exc:  # a store's refusal, a marker not ours
                log.error("cannot move rejected generation %s aside: %s", problem.generation, exc)
        if moved:
            repoint(tier, moved, rejected)
    return sorted({name for names in comm.all_gather(moved) for name in names})


def repoint(tier: CommitTier, moved: list[str], rejected: list[Problem]) -> None:
    """The filesystem leader, after its moves: a ``latest.json`` that named a moved generation
    names the newest one left that checks out (never one restore rejected, for its bytes or
    its signature), or is removed. The pointer is a hint: a failure is logged, not raised."""
    if read_latest_name(tier.store) not in moved:
        return
    skip = {p.generation for p in rejected if p.tier == tier.url}
    try:
        now = repoint_latest(tier.store, moved, skip=skip, digests=False)
    except (OSError, DistCkptError) as exc:
        log.error("cannot repoint %s after moving %s aside: %s", LATEST_NAME, ", ".join(moved), exc)
        return
    log.info("%s now names %s (it named a generation moved aside)", LATEST_NAME, now or "nothing")
