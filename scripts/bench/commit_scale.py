"""Rank 0's commit for 8 to 4096 simulated rank reports, in this process.

Uses the documented save hooks only: a ``SaveRequest`` whose ``attempt`` is
``open_tier(root).begin(generation, attempt_id)``, each rank's files written below
``attempt.local_dir`` as its ``run_save`` would leave them, one ``messages.RankReport`` per rank
posted with ``messages.post(comm, messages.report_key(generation, attempt_id, rank), report)``,
then ``dist_ckpt.save.commit.commit(request, comm, commit_timeout_s)`` timed, and the result
checked with ``dist_ckpt.format.validate.validate(tier.store, generation)``.
"""

from __future__ import annotations

import base64
import cProfile
import hashlib
import os
import pickle
import shutil
import time

from dist_ckpt.protocol.comm import Comm
from dist_ckpt.save.request import SaveRequest
from dist_ckpt.tiers import CommitTier, open_tier

from .profiling import profile_text

SCALE_RANKS = (8, 64, 512, 4096)
COMMIT_TIMEOUT_S = 300.0


class SimComm(Comm):
    """Rank 0 of ``world_size`` simulated ranks: a non-distributed ``Comm`` (its own HashStore,
    no process group) that reports ``world_size`` ranks."""

    def __init__(self, world_size: int) -> None:
        super().__init__()  # not distributed in this process: nothing collective runs
        self.world_size = world_size
        self.fs_group = list(range(world_size))


def sim_request(tier: CommitTier, world_size: int, update: int) -> SaveRequest:
    """Rank 0's request for generation ``update`` of a job of ``world_size`` ranks."""
    from torch.distributed.checkpoint.metadata import Metadata

    from dist_ckpt import __version__
    from dist_ckpt.format.manifest import generation_name
    from dist_ckpt.restart import contract
    from dist_ckpt.save.planning import PreparedSave
    from dist_ckpt.save.request import ManifestInfo

    name = generation_name(update)
    prepared = PreparedSave(planner=None, plan=None,  # type: ignore[arg-type]
                            metadata=Metadata(state_dict_metadata={}), reused=True)
    info = ManifestInfo(world_size=world_size, components=["model", "rng", "extras"], contract={},
                        contract_digest=contract.digest({}), dist_ckpt_version=__version__)
    return SaveRequest(generation=name, next_update=update, tokens_seen=0,
                       attempt=tier.begin(name, f"sim{update:06d}"), prepared=prepared,
                       rank_state=b"{}", global_state=b"{}", info=info)


def sim_reports(request: SaveRequest, comm: Comm) -> None:
    """The attempt's local directory and the store as N ranks' ``run_save`` would leave them."""
    from dist_ckpt.format.manifest import DCP_DIR, GLOBAL_STATE_FILE, STATE_DIR, rank_state_file
    from dist_ckpt.protocol import messages

    local_dir = request.attempt.local_dir
    os.makedirs(os.path.join(local_dir, DCP_DIR))
    os.makedirs(os.path.join(local_dir, STATE_DIR))
    shard, rank_json = os.urandom(1024), b'{"rng": {}}'
    digests = {data: hashlib.sha256(data).hexdigest() for data in (shard, rank_json)}
    results = base64.b64encode(pickle.dumps([])).decode("ascii")
    for rank in range(comm.world_size):
        files = [(f"{DCP_DIR}/__{rank}_0.distcp", shard), (rank_state_file(rank), rank_json)]
        if rank == 0:
            files.append((GLOBAL_STATE_FILE, rank_json))
        for rel, data in files:
            with open(os.path.join(local_dir, rel), "wb") as handle:
                handle.write(data)
        entries = [{"path": rel, "size": len(data), "sha256": digests[data], "rank": rank}
                   for rel, data in files]
        key = messages.report_key(request.generation, request.attempt_id, rank)
        messages.post(comm, key, messages.RankReport(rank, entries, results))
    os.sync()  # the ranks fsynced their files before reporting


def one_commit(root: str, world_size: int, update: int, profiler: cProfile.Profile | None) -> float:
    """Time rank 0's ``commit`` of one simulated generation; check it committed and validates."""
    from dist_ckpt.format.validate import validate
    from dist_ckpt.save.commit import commit

    tier = open_tier(root)
    comm = SimComm(world_size)
    request = sim_request(tier, world_size, update)
    sim_reports(request, comm)
    request.started = time.monotonic()
    started = time.perf_counter()
    if profiler is not None:
        outcome = profiler.runcall(commit, request, comm, COMMIT_TIMEOUT_S)
    else:
        outcome = commit(request, comm, COMMIT_TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if not outcome.ok:
        raise RuntimeError(f"simulated commit of {world_size} reports failed: {outcome.failures}")
    validate(tier.store, request.generation, digests=False)
    shutil.rmtree(os.path.join(root, request.generation))
    comm.close()
    return elapsed


def commit_scale(base: str, repeats: int, profile: bool) -> tuple[dict[int, list[float]], dict[str, str]]:
    """Rank-0 ``commit`` time for simulated report counts (+ one profiled commit of the largest)."""
    root = os.path.join(base, "commit-scale")
    os.makedirs(root)
    times: dict[int, list[float]] = {}
    update = 0
    for world_size in SCALE_RANKS:
        times[world_size] = []
        for _ in range(repeats):
            update += 1
            times[world_size].append(one_commit(root, world_size, update, None))
    profiles: dict[str, str] = {}
    if profile:
        profiler = cProfile.Profile()
        one_commit(root, SCALE_RANKS[-1], update + 1, profiler)
        profiles[f"commit() of {SCALE_RANKS[-1]} reports"] = profile_text(profiler)
    shutil.rmtree(root, ignore_errors=True)
    return times, profiles
