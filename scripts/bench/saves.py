"""Saves side by side: our async and sync save (blocking and end-to-end), the plain copy and
raw write + fsync floors, and raw DCP ``async_save`` / ``save`` of the same state."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs
from .context import Ctx
from .profiling import ThreadProfiler
from .rawio import byte_views, generation_files, raw_write

Series = dict[str, Any]


def our_save(mgr: CheckpointManager, update: int, out: dict[str, list[float]]) -> None:
    """One save (all ranks): blocking time and save() -> wait() time."""
    jobs.barrier()
    started = time.perf_counter()
    mgr.save(update)
    out["block"].append(time.perf_counter() - started)
    mgr.wait()
    out["e2e"].append(time.perf_counter() - started)


def raw_write_share(ctx: Ctx, generation_bytes: int, views: list[memoryview]) -> float:
    """Each rank writes its 1/world share of a generation's bytes + fsync, after a barrier."""
    path = os.path.join(ctx.base, f"raw-write-{ctx.rank}.bin")
    jobs.barrier()
    seconds = raw_write(path, views, generation_bytes // ctx.world)
    jobs.barrier()
    os.unlink(path)
    return seconds


def dcp_wait(response: Any) -> None:
    if hasattr(response, "upload_completion"):  # AsyncSaveResponse (async staging)
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()


def dcp_saves(ctx: Ctx, index: int, out: Series) -> None:
    """Raw DCP async_save (default options) then save of ``state.tensor_state()``, fresh dirs."""
    import torch.distributed.checkpoint as dcp

    paths = [os.path.join(ctx.base, f"dcp-{kind}-{index}") for kind in ("async", "sync")]
    jobs.barrier()
    started = time.perf_counter()
    response = dcp.async_save(ctx.state.tensor_state(), checkpoint_id=paths[0])
    out["dcp_async_block"].append(time.perf_counter() - started)
    dcp_wait(response)
    out["dcp_async_e2e"].append(time.perf_counter() - started)
    jobs.barrier()
    out["dcp_sync"].append(jobs.timed(lambda: dcp.save(ctx.state.tensor_state(), checkpoint_id=paths[1])))
    ctx.drop(*paths)


def round_steps(ctx: Ctx, index: int, amgr: CheckpointManager, smgr: CheckpointManager,
                async_root: str, out: Series) -> list[Callable[[], None]]:
    """The measurements of one round; the first is our async save (round 0 runs in this order,
    so the raw write finds a committed generation to size itself on)."""
    views = byte_views(ctx.buffers)

    def copy() -> None:
        jobs.barrier()
        out["copy"].append(jobs.copy_floor(ctx.tensors, ctx.buffers))

    def write() -> None:
        out["raw_write"].append(raw_write_share(ctx, generation_files(async_root)[2], views))

    return [lambda: our_save(amgr, index + 1, out["async"]), copy, write,
            lambda: dcp_saves(ctx, index, out), lambda: our_save(smgr, index + 1, out["sync"])]


def profiled_saves(ctx: Ctx, managers: dict[str, CheckpointManager], update: int) -> None:
    """One more save each, not measured; with --profile, rank 0's save() call runs under
    cProfile and so does the async save's background thread (:class:`ThreadProfiler`)."""
    for mode, mgr in managers.items():
        ctx.step()
        jobs.barrier()
        threads = ThreadProfiler() if ctx.profiling and mode == "async" else None
        with threads if threads is not None else contextlib.nullcontext():
            ctx.profiled(f"{mode} save() rank 0", lambda m=mgr: m.save(update))  # type: ignore[misc]
            mgr.wait()
        text = threads.text() if threads is not None else None
        if text is not None:
            ctx.profiles["async save, background thread rank 0"] = text


def phase_saves(ctx: Ctx) -> Series:
    """Rounds of: train step, then our async save, copy floor, raw write, DCP async + sync, our
    sync save -- interleaved so that drifting machine load hits every series alike, in reverse
    order every other round (no series always follows the deletions of another). Round 0 holds
    the first saves. The sync root is kept for the restore phases."""
    roots = {mode: os.path.join(ctx.base, f"ours-{mode}") for mode in ("async", "sync")}
    out: Series = {mode: {"block": [], "e2e": []} for mode in roots}
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
        profiled_saves(ctx, {"async": amgr, "sync": smgr}, ctx.repeats + 2)
    ctx.drop(roots["async"])
    name, files, total = generation_files(roots["sync"])
    out["generation"], out["generation_bytes"], out["generation_files"] = name, total, len(files)
    return out
