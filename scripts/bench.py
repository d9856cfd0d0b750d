"""The dist_ckpt benchmark: every performance target measured in one run (2 gloo ranks).

Usage: .venv/bin/python scripts/bench.py [--quick] [--state-mib N] [--repeats R] [--dir DIR]
                                         [--json bench-results.json] [--profile]

Runs, on 2 gloo ranks with ``--state-mib`` MiB of model + AdamW state per rank (benchlib.build_job):
save blocking (async vs sync vs a plain copy), commit wall time vs a raw write + fsync, raw DCP
async_save / save, restore vs a raw read, restore at 3 ranks, training step time with a save in
flight, peak RSS with 1 and 2 saves in flight; then, in this process, the rank-0 commit for 8 to
4096 simulated reports. Prints a table with each ratio next to its target and writes the JSON.
Times are the slowest rank of each repetition unless a row says otherwise. Not a test.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import cProfile
import ctypes
import hashlib
import io
import json
import os
import pickle
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
SCALE_RANKS = (8, 64, 512, 4096)
READ_CHUNK = 8 << 20

# name -> (operator, target); the ratios are computed in ``ratios``
TARGETS: dict[str, tuple[str, float]] = {
    "stall (async block / sync block)": ("<=", 0.10),
    "staging efficiency (async block / copy)": ("<=", 1.5),
    "write efficiency (commit thrpt / raw write thrpt)": (">=", 0.85),
    "our async block / DCP async_save block": ("<=", 0.25),
    "our end-to-end / DCP sync save": ("<=", 1.2),
    "restore efficiency (restore thrpt / raw read thrpt)": (">=", 0.8),
    "reshard overhead (restore 3 ranks / 2 ranks)": ("<=", 1.25),
    "interference (step in flight / idle step)": ("<=", 1.10),
    "peak RSS K=1 / (baseline + 1 x state)": ("<=", 1.10),
    "peak RSS K=2 / (baseline + 2 x state)": ("<=", 1.10),
    "commit of 4096 reports (s)": ("<", 1.0),
}


# ---- rank-side helpers -------------------------------------------------------------------
class Ctx:
    """What one rank of the main run works with."""

    def __init__(self, rank: int, world: int, cfg: dict, base: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.rank, self.world, self.cfg, self.base = rank, world, cfg, base
        self.repeats: int = cfg["repeats"]
        self.model, self.optimizer, self.state = benchlib.build_job(cfg["state_mib"], rank, world)
        self.tensors = benchlib.local_tensors(self.state.tensor_state())
        self.buffers = [torch.empty_like(t) for t in self.tensors]
        benchlib.copy_floor(self.tensors, self.buffers)  # first touch of the buffers is not the floor
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.profiles: dict[str, str] = {}

    def step(self) -> None:
        benchlib.train_step(self.model, self.optimizer)

    def profiled(self, name: str, fn: Callable[[], Any], sort: str = "cumulative") -> Any:
        """Run ``fn`` (all ranks); under cProfile on rank 0 when --profile was given."""
        if not (self.cfg["profile"] and self.rank == 0):
            return fn()
        profiler = cProfile.Profile()
        result = profiler.runcall(fn)
        self.profiles[name] = profile_text(profiler, sort=sort)
        return result

    def drop(self, *paths: str) -> None:
        """All ranks: after a barrier rank 0 deletes ``paths`` (bounded disk use)."""
        benchlib.barrier()
        if self.rank == 0:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        benchlib.barrier()


def profile_text(profiler: cProfile.Profile, top: int = 40, sort: str = "cumulative") -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class RssSampler(threading.Thread):
    """Peak resident set size of this process, sampled every ``interval_s``."""

    def __init__(self, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.interval_s = interval_s
        self.peak = rss_bytes()
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def byte_views(tensors: list) -> list[memoryview]:
    import torch

    return [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors if t.numel()]


def raw_write(path: str, views: list[memoryview], nbytes: int) -> float:
    """Sequential write of ``nbytes`` from ``views`` (cycled) into a new file, then fsync."""
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            for view in views:
                chunk = view[:left]
                while len(chunk):
                    written = os.write(fd, chunk)
                    chunk, left = chunk[written:], left - written
                if not left:
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_read(files: list[tuple[str, int]], rank: int, world: int) -> float:
    """Sequential read of this rank's 1/world of the concatenated bytes of ``files``."""
    total = sum(size for _, size in files)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buffer = memoryview(bytearray(READ_CHUNK))
    started = time.perf_counter()
    offset = 0
    for path, size in files:
        start, end = max(lo, offset), min(hi, offset + size)
        if start < end:
            with open(path, "rb", buffering=0) as handle:
                handle.seek(start - offset)
                left = end - start
                while left:
                    got = handle.readinto(buffer[: min(left, READ_CHUNK)])
                    if not got:
                        raise OSError(f"{path} is shorter than its manifest says")
                    left -= got
        offset += size
    return time.perf_counter() - started


def generation_files(root: str) -> tuple[str, list[tuple[str, int]], int]:
    """The newest committed generation under ``root``: name, (path, size) of every listed file
    and the manifest's total bytes."""
    from dist_ckpt.format.validate import list_generations, read_manifest
    from dist_ckpt.storage.local import LocalBackend

    backend = LocalBackend(root)
    name = list_generations(backend)[0]
    manifest = read_manifest(backend, name)
    files = [(os.path.join(root, name, manifest.location(f.path)), f.size) for f in manifest.files]
    return name, files, manifest.total_bytes


# ---- phases of the main 2-rank run -------------------------------------------------------
def our_save(mgr, update: int, out: dict[str, list[float]]) -> None:
    """One save (all ranks): blocking time and save() -> wait() time."""
    benchlib.barrier()
    started = time.perf_counter()
    mgr.save(update)
    out["block"].append(time.perf_counter() - started)
    mgr.wait()
    out["e2e"].append(time.perf_counter() - started)


def raw_write_share(ctx: Ctx, generation_bytes: int, views: list[memoryview]) -> float:
    """Each rank writes its 1/world share of a generation's bytes + fsync, after a barrier."""
    path = os.path.join(ctx.base, f"raw-write-{ctx.rank}.bin")
    benchlib.barrier()
    seconds = raw_write(path, views, generation_bytes // ctx.world)
    benchlib.barrier()
    os.unlink(path)
    return seconds


def dcp_wait(response: Any) -> None:
    if hasattr(response, "upload_completion"):  # AsyncSaveResponse (async staging)
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()


def dcp_saves(ctx: Ctx, index: int, out: dict[str, list[float]]) -> None:
    """Raw DCP async_save (default options) then save of ``state.tensor_state()``, fresh dirs."""
    import torch.distributed.checkpoint as dcp

    paths = [os.path.join(ctx.base, f"dcp-{kind}-{index}") for kind in ("async", "sync")]
    benchlib.barrier()
    started = time.perf_counter()
    response = dcp.async_save(ctx.state.tensor_state(), checkpoint_id=paths[0])
    out["dcp_async_block"].append(time.perf_counter() - started)
    dcp_wait(response)
    out["dcp_async_e2e"].append(time.perf_counter() - started)
    benchlib.barrier()
    out["dcp_sync"].append(benchlib.timed(
        lambda: dcp.save(ctx.state.tensor_state(), checkpoint_id=paths[1])))
    ctx.drop(*paths)


@contextlib.contextmanager
def profiled_background(ctx: Ctx, name: str):
    """With --profile on rank 0: the background thread of saves started inside runs under
    cProfile (cProfile sees one thread; the manager's name for its thread target is swapped
    meanwhile: ``run_save_in_background`` where the library has it, else ``run_save``)."""
    import dist_ckpt.manager as manager_mod

    target = "run_save_in_background" if hasattr(manager_mod, "run_save_in_background") else "run_save"
    original = getattr(manager_mod, target)
    if not (ctx.cfg["profile"] and ctx.rank == 0):
        yield
        return
    profiler = cProfile.Profile()
    setattr(manager_mod, target, lambda *args: profiler.runcall(original, *args))
    try:
        yield
    finally:
        setattr(manager_mod, target, original)
    if profiler.getstats():
        ctx.profiles[name] = profile_text(profiler)


def round_steps(ctx: Ctx, index: int, amgr, smgr, async_root: str, out: dict) -> list[Callable[[], Any]]:
    """The measurements of one round; the first is our async save (round 0 runs in this order,
    so the raw write finds a committed generation to size itself on)."""
    views = byte_views(ctx.buffers)

    def copy() -> None:
        benchlib.barrier()
        out["copy"].append(benchlib.copy_floor(ctx.tensors, ctx.buffers))

    def write() -> None:
        out["raw_write"].append(raw_write_share(ctx, generation_files(async_root)[2], views))

    return [lambda: our_save(amgr, index + 1, out["async"]), copy, write,
            lambda: dcp_saves(ctx, index, out), lambda: our_save(smgr, index + 1, out["sync"])]


def phase_saves(ctx: Ctx) -> dict:
    """Rounds of: train step, then our async save, copy floor, raw write, DCP async + sync, our
    sync save -- interleaved so that drifting machine load hits every series alike, in reverse
    order every other round (no series always follows the deletions of another). Round 0 holds
    the first saves. The sync root is kept for the restore phases."""
    from dist_ckpt import CheckpointConfig, CheckpointManager

    roots = {mode: os.path.join(ctx.base, f"ours-{mode}") for mode in ("async", "sync")}
    out: dict[str, Any] = {mode: {"block": [], "e2e": []} for mode in roots}
    out.update(copy=[], raw_write=[], dcp_async_block=[], dcp_async_e2e=[], dcp_sync=[])
    configs = {mode: CheckpointConfig(root=root, async_save=mode == "async", keep_last=2)
               for mode, root in roots.items()}
    with CheckpointManager(configs["async"], ctx.state) as amgr, \
            CheckpointManager(configs["sync"], ctx.state) as smgr:
        for index in range(ctx.repeats + 1):
            ctx.step()
            steps = round_steps(ctx, index, amgr, smgr, roots["async"], out)
            for step in steps if index % 2 == 0 else reversed(steps):  # alternate the order
                step()
        extra = ctx.repeats + 2  # one more save each, not measured, under cProfile on rank 0
        for mode, mgr in (("async", amgr), ("sync", smgr)):
            ctx.step()
            benchlib.barrier()
            background = profiled_background(ctx, "async save, background thread rank 0") \
                if mode == "async" else contextlib.nullcontext()
            with background:
                ctx.profiled(f"{mode} save() rank 0", lambda m=mgr: m.save(extra))
                mgr.wait()
    ctx.drop(roots["async"])
    name, files, total = generation_files(roots["sync"])
    out["generation"], out["generation_bytes"], out["generation_files"] = name, total, len(files)
    return out


def phase_restore(ctx: Ctx, root: str) -> dict:
    """mgr.restore() at this world size, each followed by a raw read of the same files."""
    from dist_ckpt import CheckpointConfig, CheckpointManager

    _, files, _ = generation_files(root)
    out: dict[str, list[float]] = {"restore": [], "read": []}
    with CheckpointManager(CheckpointConfig(root=root), ctx.state) as mgr:
        mgr.restore()  # warm-up: page cache and first-call costs, not measured
        for _ in range(ctx.repeats):
            benchlib.barrier()
            out["restore"].append(benchlib.timed(mgr.restore))
            benchlib.barrier()
            out["read"].append(raw_read(files, ctx.rank, ctx.world))
        benchlib.barrier()
        ctx.profiled("restore() rank 0, 2 ranks", mgr.restore)
    return out


def steps_while(ctx: Ctx, job, limit: int) -> list[float]:
    """Train steps until any rank's ``job`` is done (None: ``limit`` steps); only steps are timed.

    One tiny all-reduce per step keeps the ranks' step counts equal (FSDP steps are collective).
    """
    import torch
    import torch.distributed as dist

    times: list[float] = []
    flag = torch.zeros(1)
    while len(times) < limit:
        flag[0] = 1.0 if job is not None and job.done.is_set() else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        times.append(benchlib.timed(ctx.step))
    return times


def phase_interference(ctx: Ctx) -> dict:
    """Step time with no save in flight vs while an async save (write, hash, commit) runs."""
    from dist_ckpt import CheckpointConfig, CheckpointManager

    root = os.path.join(ctx.base, "interference")
    out: dict[str, list] = {"idle": [], "inflight": [], "steps_per_save": []}
    wanted = max(10, 3 * ctx.repeats)
    steps_while(ctx, None, 2)  # warm-up
    out["idle"] = steps_while(ctx, None, wanted)
    config = CheckpointConfig(root=root, async_save=True, keep_last=2)
    with CheckpointManager(config, ctx.state) as mgr:
        mgr.save(1)  # first save allocates the staging buffers: not measured
        mgr.wait()
        update = 1
        # at least ``repeats`` saves, and more (up to 4x) until enough steps ran in flight
        while update <= ctx.repeats or (len(out["inflight"]) < wanted and update <= 4 * ctx.repeats):
            update += 1
            benchlib.barrier()
            job = mgr.save(update)
            steps = steps_while(ctx, job, 10_000)
            out["inflight"].extend(steps)
            out["steps_per_save"].append(len(steps))
            mgr.wait()  # step counts agree across ranks (steps_while), so does the loop
        if ctx.cfg["profile"]:  # one more step each way, not measured, under cProfile on rank 0
            ctx.profiled("train step rank 0, no save in flight", ctx.step, sort="tottime")
            mgr.save(update + 1)
            ctx.profiled("train step rank 0, async save in flight", ctx.step, sort="tottime")
            mgr.wait()
    out["idle"].extend(steps_while(ctx, None, wanted))
    ctx.drop(root)
    return out


def rank_main(rank: int, world: int, cfg: dict, base: str) -> dict:
    ctx = Ctx(rank, world, cfg, base)
    walls: dict[str, float] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = fn()
        walls[name] = time.perf_counter() - started
        return result

    out: dict[str, Any] = {"rank": rank, "state_bytes": ctx.state_bytes}
    out["saves"] = phase("saves, raw write, DCP", lambda: phase_saves(ctx))
    out["restore"] = phase("restore", lambda: phase_restore(ctx, os.path.join(base, "ours-sync")))
    out["interference"] = phase("interference", lambda: phase_interference(ctx))
    out["walls"], out["profiles"] = walls, ctx.profiles
    return out


# ---- the other multi-rank runs -----------------------------------------------------------
def rank_reshard(rank: int, world: int, cfg: dict, root: str) -> dict:
    """Restore, at ``world`` ranks, the generation a 2-rank run left (model sized for 2 ranks)."""
    import torch

    from dist_ckpt import CheckpointConfig, CheckpointManager

    torch.set_num_threads(1)
    _, _, state = benchlib.build_job_sized(cfg["state_mib"], rank, world, size_world=2)
    times = []
    profiles: dict[str, str] = {}
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        generation = mgr.restore().generation  # warm-up, not measured
        for _ in range(cfg["repeats"]):
            benchlib.barrier()
            times.append(benchlib.timed(mgr.restore))
        if cfg["profile"] and rank == 0:
            profiler = cProfile.Profile()
            profiler.runcall(mgr.restore)
            profiles[f"restore() rank 0, {world} ranks"] = profile_text(profiler)
        elif cfg["profile"]:
            mgr.restore()
    return {"restore": times, "generation": generation, "profiles": profiles}


def rank_memory(rank: int, world: int, cfg: dict, base: str, slots: int) -> dict:
    """Peak RSS while async saves run with ``max_in_flight=slots`` (two saves back-to-back)."""
    import torch

    from dist_ckpt import CheckpointConfig, CheckpointManager

    torch.set_num_threads(1)
    _, _, state = benchlib.build_job(cfg["state_mib"], rank, world)
    state_bytes = sum(t.numel() * t.element_size() for t in benchlib.local_tensors(state.tensor_state()))
    root = os.path.join(base, f"memory-{slots}")
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap (model built unsharded) is not baseline
    benchlib.barrier()
    baseline = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    config = CheckpointConfig(root=root, async_save=True, max_in_flight=slots, keep_last=2)
    with CheckpointManager(config, state) as mgr:
        for rep in range(cfg["repeats"]):
            benchlib.barrier()
            mgr.save(2 * rep + 1)
            mgr.save(2 * rep + 2)  # returns at once when slots == 2; waits for the first when 1
            mgr.wait()
        staging_peak = mgr.staging.peak_bytes
    peak = sampler.stop()
    benchlib.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"baseline": baseline, "peak": peak, "state_bytes": state_bytes, "slots": slots,
            "staging_peak": staging_peak, "samples": sampler.samples}


# ---- commit at scale (one process, simulated reports) ------------------------------------
def sim_comm(world_size: int):
    import torch.distributed as dist

    from dist_ckpt.protocol.comm import Comm

    class SimComm(Comm):
        """Rank 0 of ``world_size`` ranks with a private HashStore; no process group."""

        def __init__(self) -> None:  # deliberately not Comm.__init__: nothing collective runs
            self.rank, self.world_size, self.distributed = 0, world_size, False
            self.group = None
            self.session = "sim"
            self.store = dist.HashStore()

    return SimComm()


def sim_request(root: str, world_size: int, update: int):
    from torch.distributed.checkpoint.metadata import Metadata

    from dist_ckpt.format.manifest import PENDING_PREFIX, generation_name
    from dist_ckpt.restart import contract
    from dist_ckpt.save.coordinator import SaveRequest
    from dist_ckpt.save.planning import PreparedSave
    from dist_ckpt.tiers.rename import PublishInfo
    from dist_ckpt.version import __version__

    name = generation_name(update)
    prepared = PreparedSave(planner=None, plan=None, metadata=Metadata(state_dict_metadata={}),
                            reused=True)
    info = PublishInfo(world_size=world_size, components=["model", "rng", "extras"], contract={},
                       contract_digest=contract.digest({}), dist_ckpt_version=__version__)
    return SaveRequest(generation=name, next_update=update, tokens_seen=0, root=root,
                       pending_name=f"{PENDING_PREFIX}{name}-sim{update:06d}", prepared=prepared,
                       rank_state=b"{}", global_state=b"{}", info=info)


def sim_pending(request, comm) -> None:
    """The pending directory and the store as N ranks' run_save would leave them."""
    from dist_ckpt.format.manifest import DCP_DIR, GLOBAL_STATE_FILE, STATE_DIR, rank_state_file
    from dist_ckpt.save.coordinator import _report_key

    os.makedirs(os.path.join(request.pending, DCP_DIR))
    os.makedirs(os.path.join(request.pending, STATE_DIR))
    shard, rank_json = os.urandom(1024), b'{"rng": {}}'
    digests = {data: hashlib.sha256(data).hexdigest() for data in (shard, rank_json)}
    results = base64.b64encode(pickle.dumps([])).decode("ascii")
    for rank in range(comm.world_size):
        files = [(f"{DCP_DIR}/__{rank}_0.distcp", shard), (rank_state_file(rank), rank_json)]
        if rank == 0:
            files.append((GLOBAL_STATE_FILE, rank_json))
        for rel, data in files:
            with open(os.path.join(request.pending, rel), "wb") as handle:
                handle.write(data)
        entries = [{"path": rel, "size": len(data), "sha256": digests[data], "rank": rank}
                   for rel, data in files]
        report = {"rank": rank, "files": entries, "results": results}
        comm.store_set(_report_key(request.generation, request.pending_name, rank),
                       json.dumps(report).encode())
    os.sync()  # the ranks fsynced their files before reporting


def one_commit(root: str, world_size: int, update: int, profiler: cProfile.Profile | None) -> float:
    """Time rank 0's ``commit`` of one simulated generation; check it committed and validates."""
    from dist_ckpt.format.validate import validate
    from dist_ckpt.save.coordinator import commit
    from dist_ckpt.storage.local import LocalBackend

    comm = sim_comm(world_size)
    request = sim_request(root, world_size, update)
    sim_pending(request, comm)
    request.started = time.monotonic()
    started = time.perf_counter()
    if profiler is not None:
        outcome = profiler.runcall(commit, request, comm, 300.0)
    else:
        outcome = commit(request, comm, 300.0)
    elapsed = time.perf_counter() - started
    if not outcome["ok"]:
        raise RuntimeError(f"simulated commit of {world_size} reports failed: {outcome}")
    validate(LocalBackend(root), request.generation, digests=False)
    shutil.rmtree(os.path.join(root, request.generation))
    return elapsed


def commit_scale(base: str, repeats: int, profile: bool) -> tuple[dict, dict]:
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


# ---- analysis and output -----------------------------------------------------------------
def slowest(per_rank: list[list[float]]) -> list[float]:
    return [max(values) for values in zip(*per_rank, strict=True)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def timing_rows(main: list[dict], reshard: list[dict], scale: dict) -> dict[str, list[float]]:
    """Every timed series (seconds), first saves split off, slowest rank per repetition."""
    def get(*keys: str, rank: int | None = None) -> list[float]:
        def one(result: dict) -> list[float]:
            for key in keys:
                result = result[key]
            return list(result)  # type: ignore[arg-type]
        return one(main[rank]) if rank is not None else slowest([one(r) for r in main])

    rows: dict[str, list[float]] = {}
    for mode in ("async", "sync"):
        block = get("saves", mode, "block")
        rows[f"our {mode} save() blocking, first"], rows[f"our {mode} save() blocking"] = block[:1], block[1:]
    rows["plain copy into preallocated buffers"] = get("saves", "copy")[1:]
    e2e = get("saves", "async", "e2e", rank=0)
    rows["our async commit, save() -> wait() rank 0, first"] = e2e[:1]
    rows["our async commit, save() -> wait() rank 0"] = e2e[1:]
    rows["our sync save() rank 0"] = get("saves", "sync", "e2e", rank=0)[1:]
    rows["raw write + fsync of the generation bytes"] = get("saves", "raw_write")[1:]
    for key, label in (("dcp_async_block", "DCP async_save blocking"),
                       ("dcp_async_e2e", "DCP async_save end-to-end"), ("dcp_sync", "DCP save (sync)")):
        series = get("saves", key)
        rows[f"{label}, first"], rows[label] = series[:1], series[1:]
    rows["our restore(), 2 ranks"] = get("restore", "restore")
    rows["raw read of the generation files, 2 ranks"] = get("restore", "read")
    rows["our restore(), 3 ranks"] = slowest([r["restore"] for r in reshard])
    rows["train step, no save in flight (rank 0)"] = get("interference", "idle", rank=0)
    rows["train step, async save in flight (rank 0)"] = get("interference", "inflight", rank=0)
    for world_size, values in scale.items():
        rows[f"commit of {world_size} simulated reports"] = values
    return rows


def ratios(rows: dict[str, list[float]], memory: dict[int, list[dict]]) -> dict[str, float]:
    def q(numerator: str, denominator: str) -> float:
        return median(rows[numerator]) / median(rows[denominator])

    our_block, our_e2e = "our async save() blocking", "our async commit, save() -> wait() rank 0"
    restore2 = "our restore(), 2 ranks"
    out = {
        "stall (async block / sync block)": q(our_block, "our sync save() blocking"),
        "staging efficiency (async block / copy)": q(our_block, "plain copy into preallocated buffers"),
        "write efficiency (commit thrpt / raw write thrpt)":
            q("raw write + fsync of the generation bytes", our_e2e),
        "our async block / DCP async_save block": q(our_block, "DCP async_save blocking"),
        "our end-to-end / DCP sync save": q(our_e2e, "DCP save (sync)"),
        "restore efficiency (restore thrpt / raw read thrpt)":
            q("raw read of the generation files, 2 ranks", restore2),
        "reshard overhead (restore 3 ranks / 2 ranks)": q("our restore(), 3 ranks", restore2),
        "interference (step in flight / idle step)":
            q("train step, async save in flight (rank 0)", "train step, no save in flight (rank 0)"),
        "commit of 4096 reports (s)": median(rows[f"commit of {SCALE_RANKS[-1]} simulated reports"]),
    }
    for slots, results in memory.items():
        out[f"peak RSS K={slots} / (baseline + {slots} x state)"] = max(
            r["peak"] / (r["baseline"] + slots * r["state_bytes"]) for r in results)
    return out


def passes(name: str, value: float) -> bool:
    op, target = TARGETS[name]
    return {"<=": value <= target, ">=": value >= target, "<": value < target}[op]


def print_table(rows: dict[str, list[float]], ratio_values: dict[str, float],
                memory: dict[int, list[dict]]) -> None:
    print(f"\n{'timing (s; slowest rank per repetition unless noted)':58s} {'median':>9s} {'min':>9s} "
          f"{'max':>9s} {'n':>4s}")
    for name, values in rows.items():
        print(f"{name:58s} {median(values):9.4f} {min(values):9.4f} {max(values):9.4f} {len(values):4d}")
    print(f"\n{'memory (MiB)':30s} {'rank':>4s} {'baseline':>9s} {'state':>8s} {'staging':>8s} "
          f"{'expected':>9s} {'peak':>8s}")
    for slots, results in memory.items():
        for rank, r in enumerate(results):
            expected = r["baseline"] + slots * r["state_bytes"]
            print(f"{f'async, max_in_flight={slots}':30s} {rank:4d} {r['baseline'] / benchlib.MiB:9.0f} "
                  f"{r['state_bytes'] / benchlib.MiB:8.0f} {r['staging_peak'] / benchlib.MiB:8.0f} "
                  f"{expected / benchlib.MiB:9.0f} {r['peak'] / benchlib.MiB:8.0f}")
    print(f"\n{'ratio':54s} {'value':>8s} {'target':>9s}  result")
    for name, value in ratio_values.items():
        op, target = TARGETS[name]
        print(f"{name:54s} {value:8.3f} {op:>3s} {target:5.2f}  {'PASS' if passes(name, value) else 'MISS'}")


def run_all(args: argparse.Namespace, cfg: dict, base: str, walls: dict) -> dict:
    from dist_ckpt.testing import run_ranks

    def timed_run(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        result = fn()
        walls[name] = time.perf_counter() - started
        print(f"[bench] {name}: {walls[name]:.1f} s", flush=True)
        return result

    main = timed_run("main run (2 ranks)", lambda: run_ranks(2, rank_main, cfg, base, timeout_s=3600))
    reshard = timed_run("reshard run (3 ranks)", lambda: run_ranks(
        3, rank_reshard, cfg, os.path.join(base, "ours-sync"), timeout_s=3600))
    shutil.rmtree(os.path.join(base, "ours-sync"), ignore_errors=True)
    memory = {slots: timed_run(f"memory run K={slots} (2 ranks)", lambda s=slots: run_ranks(
        2, rank_memory, cfg, base, s, timeout_s=3600)) for slots in (1, 2)}
    scale, scale_profiles = timed_run("commit scale (1 process)",
                                      lambda: commit_scale(base, cfg["repeats"], cfg["profile"]))
    profiles = {**main[0]["profiles"], **reshard[0]["profiles"], **scale_profiles}
    return {"main": main, "reshard": reshard, "memory": memory, "scale": scale, "profiles": profiles}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB per rank, 3 repetitions")
    parser.add_argument("--state-mib", type=int, default=None, help="per-rank state (default 512)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 5, quick 3)")
    parser.add_argument("--dir", default=None, help="parent of the benchmark directory (default: temp)")
    parser.add_argument("--json", default="bench-results.json", help="where to write the results")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile one extra rank-0 save()/restore()/commit and print the top entries")
    args = parser.parse_args()
    args.state_mib = args.state_mib or (64 if args.quick else 512)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 3 or (args.repeats < 5 and not args.quick):
        parser.error("--repeats must be >= 5 (>= 3 with --quick)")
    return args


def main() -> None:
    args = parse_args()
    cfg = {"state_mib": args.state_mib, "repeats": args.repeats, "profile": args.profile}
    started = time.perf_counter()
    walls: dict[str, float] = {}
    base = tempfile.mkdtemp(prefix="bench-", dir=args.dir)
    try:
        raw = run_all(args, cfg, base, walls)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    walls["total"] = time.perf_counter() - started
    rows = timing_rows(raw["main"], raw["reshard"], raw["scale"])
    ratio_values = ratios(rows, raw["memory"])
    saves = raw["main"][0]["saves"]
    print(f"\n{benchlib.machine()}")
    local_mib = raw["main"][0]["state_bytes"] / benchlib.MiB
    print(f"state {args.state_mib} MiB per rank ({local_mib:.0f} MiB local tensors), 2 gloo ranks, "
          f"{args.repeats} repetitions; generation {saves['generation_bytes'] / benchlib.MiB:.0f} MiB in "
          f"{saves['generation_files']} files; wall {walls['total']:.0f} s")
    steps = raw["main"][0]["interference"]["steps_per_save"]
    print(f"interference: {len(steps)} async saves, train steps run while each was in flight: {steps}")
    print_table(rows, ratio_values, raw["memory"])
    for name, text in raw["profiles"].items():
        print(f"\n---- cProfile: {name} ----\n{text}")
    document = {
        "machine": benchlib.machine(), "config": cfg, "walls_s": walls,
        "timings_s": {name: {**benchlib.summary(values), "values": values} for name, values in rows.items()},
        "ratios": {name: {"value": value, "op": TARGETS[name][0], "target": TARGETS[name][1],
                          "pass": passes(name, value)} for name, value in ratio_values.items()},
        "memory": {str(k): v for k, v in raw["memory"].items()},
        "per_rank": raw["main"], "reshard": raw["reshard"], "profiles": raw["profiles"],
    }
    with open(args.json, "w") as handle:
        json.dump(document, handle, indent=1, default=str)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
