"""The compare phase: dist_ckpt against raw DCP on the same job and the same tensors.

One 2-rank run (fresh processes) measures every method of ``compare_methods`` in rounds, the
method order reversed every other round, each method's measurements back to back:

- a standalone save after a barrier, no training: ``save()`` blocking, save to durable
  (``finish``), and the process CPU time (user, system: ``getrusage``, every thread) of the
  save and its completion, nothing else running;
- training time lost: ``steps`` train steps with one save started before the first (the save's
  blocking call, the steps, then the wait for what is left of the save), minus ``steps`` train
  steps without a save, the two runs adjacent and their order alternated. Before each
  ``optimizer.step()`` the caller waits for what the method requires (DCP async staging: its
  ``staging_completion``; the lazy snapshot hooks the step itself);
- a plain copy of the rank's tensors into preallocated buffers (the eager staging floor).

Then, on the newest generation the sync manager committed: verified ``restore()`` against an
unverified ``dcp.load`` of that generation's ``dcp/`` directory (plus ``set_state_dict``, which
``restore()`` does too), alternated, both after one unmeasured warm-up each; by default cold
(``--restore-cache cold``: the generation's files dropped from the page cache before each call,
as a restarted job finds them), or warm (nothing dropped), the same conditions for both. A
second, 3-rank run does the same on the 2-rank generation (reshard).

Both jobs also measure the physical floor of a save's CPU (``floor_series``): one copy of the
rank's tensors into preallocated buffers plus one BLAKE3 pass (one thread, the library's
digest) over the copied bytes, CPU seconds of this thread.

The fine-tuning job (``--job finetune``, issue 28) has three columns (``FINETUNE_ORDER``:
incremental, ``incremental=False``, DCP ``async_save``). Bytes written are counted for every
save after the first (the first, which writes the frozen base, is the unmeasured warm-up and is
reported apart). Its restore: one more save of each method with nothing changing in between
(the DCP one kept), a copy of the rank's tensors as the reference, then rounds of the three
restores (incremental generation, full generation, ``dcp.load`` of the kept DCP save), each
after an untimed in-place change of every parameter and optimizer state tensor and followed by
an untimed bitwise comparison with the reference. Then, with a moto S3 server (``mirror``),
the bytes each generation's mirror upload puts there, incremental and full. The reshard run
restores the incremental generation.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs
from .compare_methods import (
    DCP_ASYNC,
    DCP_SYNC,
    OUR_EAGER,
    OUR_FULL,
    OUR_SYNC,
    DcpSave,
    Method,
    OurSave,
    build_methods,
    dcp_state,
    lazy_supported,
)
from .rawio import evict


@dataclass
class Job:
    """One rank's job and what every measurement needs."""

    rank: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: Any
    steps: int
    group: dist.ProcessGroup
    out: dict[str, Any] = field(default_factory=dict)

    def run_steps(self, count: int, handle: Any = None, method: Method | None = None) -> None:
        hook = (lambda: method.before_step(handle)) if method is not None else None
        for _ in range(count):
            jobs.train_step(self.model, self.optimizer, before_step=hook)


def cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def trainable_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of what training changes: trained parameters and the optimizer state."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return jobs.tensor_bytes(jobs.local_tensors(trained)) + \
        jobs.tensor_bytes(jobs.local_tensors(optimizer.state_dict()["state"]))


def global_bytes(tensors: list[Any]) -> int:
    """Bytes of the whole tensors (a DTensor counts its global shape, once): what one
    checkpoint of them holds, whatever the sharding or replication."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def trainable_global_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the trainable tensors of the whole job (every rank computes the same): trained
    parameters and the optimizer state, replicated ones (DDP) counted once."""
    trained = [p for p in model.parameters() if p.requires_grad]
    state = [v for per_param in optimizer.state.values() for v in per_param.values()]
    return global_bytes(trained) + global_bytes(state)


def small_state_bytes(root: str) -> int:
    """Bytes of the newest generation under ``root`` other than tensor data (``.distcp`` files
    and shared objects): the manifest, DCP's ``.metadata``, sampler, RNG and the other small
    state a generation always carries."""
    from dist_ckpt.format.manifest import is_object_path
    from dist_ckpt.format.validate import list_generations, validate
    from dist_ckpt.tiers import open_tier

    tier = open_tier(root)
    name = list_generations(tier.store)[0]
    manifest = validate(tier.store, name, digests=False)
    listed = sum(f.size for f in manifest.files
                 if not is_object_path(f.path) and not f.path.endswith(".distcp"))
    unlisted = [os.path.join(root, name, n) for n in os.listdir(os.path.join(root, name))
                if os.path.isfile(os.path.join(root, name, n))]  # the manifest, its signature
    return listed + sum(os.path.getsize(p) for p in unlisted)


def standalone(job: Job, method: Method, series: dict[str, list[float]]) -> None:
    """One save, nothing else running: blocking, to durable, CPU user and system seconds."""
    jobs.barrier()
    user, system = cpu_seconds()
    started = time.perf_counter()
    handle = method.start()
    series["block"].append(time.perf_counter() - started)
    method.finish(handle)
    series["e2e"].append(time.perf_counter() - started)
    user_after, system_after = cpu_seconds()
    series["cpu_user"].append(user_after - user)
    series["cpu_sys"].append(system_after - system)
    series["written"].append(float(method.written_bytes()))
    method.cleanup()


def steps_run(job: Job, method: Method | None) -> tuple[float, float, float]:
    """``job.steps`` train steps, with one save of ``method`` started before the first and
    waited for after the last: wall seconds, CPU seconds (user + system), blocking seconds."""
    jobs.barrier()
    cpu_before = sum(cpu_seconds())
    started = time.perf_counter()
    handle, blocking = None, 0.0
    if method is not None:
        handle = method.start()
        blocking = time.perf_counter() - started
    job.run_steps(job.steps, handle, method)
    if method is not None:
        method.finish(handle)
    elapsed = time.perf_counter() - started
    cpu = sum(cpu_seconds()) - cpu_before
    if method is not None:
        method.written_bytes()  # untimed: objects written by this save are not the next one's
        method.cleanup()
    return elapsed, cpu, blocking


def lost_pair(job: Job, method: Method, with_first: bool, series: dict[str, list[float]]) -> None:
    """Steps with a save and without, adjacent, in the order given."""
    runs = {}
    for saving in ((True, False) if with_first else (False, True)):
        runs[saving] = steps_run(job, method if saving else None)
    (with_s, with_cpu, blocking), (without_s, without_cpu, _) = runs[True], runs[False]
    series["steps_with"].append(with_s)
    series["steps_without"].append(without_s)
    series["lost"].append(with_s - without_s)
    series["cpu_lost"].append(with_cpu - without_cpu)
    series["block_in_steps"].append(blocking)


SERIES = ("block", "e2e", "cpu_user", "cpu_sys", "steps_with", "steps_without", "lost", "cpu_lost",
          "block_in_steps", "written")


def measure_saves(job: Job, methods: dict[str, Method], repeats: int,
                  lost_pairs: int) -> dict[str, dict[str, list[float]]]:
    """Rounds of every method (order reversed every other round) after one warm-up save each:
    a standalone save in the first ``repeats`` rounds, a with / without pair of step runs in
    the first ``lost_pairs`` (the time lost is a small difference of two long runs: it takes
    more pairs than the standalone figures take repetitions to rise above the noise)."""
    out = {name: {key: [] for key in SERIES} for name in methods}
    job.run_steps(2)  # warm-up
    for method in methods.values():  # first saves allocate staging buffers and plans: not measured
        first = {key: [] for key in SERIES}
        standalone(job, method, first)
        out[method.name]["first_written"] = first["written"]  # generation 1, reported apart
    for index in range(max(repeats, lost_pairs)):
        order = list(methods.values())
        for method in order if index % 2 == 0 else reversed(order):
            if index < repeats:
                standalone(job, method, out[method.name])
            if index < lost_pairs:
                lost_pair(job, method, index % 2 == 0, out[method.name])
    return out


def generation_dcp_dir(root: str) -> tuple[str, str]:
    """The newest committed generation under ``root`` and its DCP directory."""
    from dist_ckpt.format.manifest import METADATA_FILE
    from dist_ckpt.format.validate import list_generations, validate
    from dist_ckpt.tiers import open_tier

    tier = open_tier(root)
    name = list_generations(tier.store)[0]
    manifest = validate(tier.store, name, digests=False)
    location = os.path.dirname(manifest.location(METADATA_FILE))
    return name, os.path.join(root, name, location)


def dcp_load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str,
             group: dist.ProcessGroup | None) -> None:
    """What a raw DCP user runs to resume: ``dcp.load`` into the state dicts, then set them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def measure_restore(mgr: CheckpointManager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    path: str, group: dist.ProcessGroup | None, repeats: int,
                    cold: bool = True) -> dict[str, list[float]]:
    """Verified ``restore()`` vs unverified ``dcp.load`` of the same files, alternated; with
    ``cold``, the generation's files are dropped from the page cache before each (untimed)."""
    def load() -> None:
        dcp_load(model, optimizer, path, group)

    generation_dir = os.path.dirname(os.path.normpath(path))
    return time_restores({"verified": mgr.restore, "dcp_load": load}, repeats,
                         before=(lambda: evict(generation_dir)) if cold else None)


def time_restores(steps: dict[str, Callable[[], Any]], repeats: int,
                  before: Callable[[], None] | None = None,
                  check: Callable[[], bool] | None = None) -> dict[str, Any]:
    """All ranks: each restore of ``steps`` once unmeasured (page cache and first-call costs,
    the same for all), then ``repeats`` rounds in alternating order, timed. ``before`` runs
    untimed before every call, ``check`` untimed after it; with ``check``, the result has
    ``bitwise``: per step, whether every check held."""
    out: dict[str, Any] = {name: [] for name in steps}
    equal = {name: True for name in steps}

    def call(name: str, timed: bool) -> None:
        if before is not None:
            before()
        jobs.barrier()
        seconds = jobs.timed(steps[name])
        if timed:
            out[name].append(seconds)
        if check is not None:
            equal[name] = check() and equal[name]

    for name in steps:
        call(name, timed=False)
    for index in range(repeats):
        for name in list(steps) if index % 2 == 0 else reversed(list(steps)):
            call(name, timed=True)
    if check is not None:
        out["bitwise"] = equal
    return out


def perturb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Change every parameter and optimizer state tensor in place (a restore that skipped one
    leaves it different from the saved bytes)."""
    with torch.no_grad():
        for tensor in jobs.local_tensors([list(model.parameters()), list(optimizer.state.values())]):
            tensor.add_(1)


def same_tensors(state: Any, reference: list[torch.Tensor]) -> bool:
    """This rank's tensors of ``state`` bitwise equal to ``reference``."""
    now = jobs.local_tensors(state.tensor_state())
    return len(now) == len(reference) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(now, reference, strict=True))


def finetune_restore(job: Job, methods: dict[str, Method], group: dist.ProcessGroup,
                     repeats: int) -> dict[str, Any]:
    """All ranks, fine-tuning job: one more save of each method of the same state (nothing runs
    in between; DCP's kept), then the three restores timed in rounds, each after ``perturb``
    and checked bitwise against the tensors saved (both untimed)."""
    incremental, full, raw = methods[OUR_EAGER], methods[OUR_FULL], methods[DCP_ASYNC]
    assert isinstance(incremental, OurSave) and isinstance(full, OurSave) and isinstance(raw, DcpSave)
    jobs.barrier()
    for method in (incremental, full):
        method.finish(method.start())
        method.written_bytes()
    kept = raw.save_kept()
    reference = [t.detach().clone() for t in jobs.local_tensors(job.state.tensor_state())]
    steps: dict[str, Callable[[], Any]] = {
        OUR_EAGER: incremental.mgr.restore, OUR_FULL: full.mgr.restore,
        DCP_ASYNC: lambda: dcp_load(job.model, job.optimizer, kept, group)}
    try:
        return time_restores(steps, repeats, before=lambda: perturb(job.model, job.optimizer),
                             check=lambda: same_tensors(job.state, reference))
    finally:
        jobs.barrier()
        if job.rank == 0:
            shutil.rmtree(kept, ignore_errors=True)


def floor_series(job: Job, repeats: int) -> dict[str, list[float]]:
    """The physical floor of a save's CPU, ``repeats`` times: CPU seconds of this thread for one
    copy of the rank's tensors into preallocated buffers, and for one BLAKE3 pass (one thread,
    ``HASH_CHUNK`` updates, as the library's writer hashes) over the copied bytes."""
    from dist_ckpt.digests import HASH_CHUNK, hasher

    from .rawio import byte_views

    tensors = jobs.local_tensors(job.state.tensor_state())
    buffers = [torch.empty_like(t) for t in tensors]
    jobs.copy_floor(tensors, buffers)  # first touch of the buffers is not the floor
    views = byte_views(buffers)
    out: dict[str, list[float]] = {"copy_cpu": [], "hash_cpu": []}
    for _ in range(repeats):
        jobs.barrier()
        started = time.thread_time()
        jobs.copy_floor(tensors, buffers)
        copied = time.thread_time()
        digest = hasher("blake3")
        for view in views:
            for offset in range(0, len(view), HASH_CHUNK):
                digest.update(view[offset:offset + HASH_CHUNK])
        digest.hexdigest()
        out["copy_cpu"].append(copied - started)
        out["hash_cpu"].append(time.thread_time() - copied)
    return out


def copy_series(job: Job, repeats: int) -> list[float]:
    """A plain copy of the rank's local tensors into preallocated buffers (eager staging floor)."""
    tensors = jobs.local_tensors(job.state.tensor_state())
    buffers = [torch.empty_like(t) for t in tensors]
    jobs.copy_floor(tensors, buffers)  # first touch of the buffers is not the floor
    times = []
    for _ in range(repeats):
        jobs.barrier()
        times.append(jobs.copy_floor(tensors, buffers))
    return times


def profile_cpu(job: Job, method: Method) -> dict[str, Any] | None:
    """--profile-cpu: one more save of ``method`` (all ranks), rank 0's under :class:`CpuProfile`
    (started before the barrier: py-spy attaches first)."""
    from .cpu_profile import CpuProfile

    if job.rank != 0:
        jobs.barrier()
        method.finish(method.start())
        return None
    with CpuProfile() as profile:
        jobs.barrier()
        method.finish(method.start())
    return profile.result


def rank_compare(rank: int, world: int, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    """One rank of the 2-rank compare run; leaves the root the reshard run restores (our sync
    save's, or for the fine-tuning job the incremental one's)."""
    torch.set_num_threads(1)
    kind, job_name = cfg.get("kind", "fsdp"), cfg.get("job", "full")
    finetune = job_name == "finetune"
    model, optimizer, state = jobs.build_job(cfg["state_mib"], rank, world, kind, job_name)
    job = Job(rank, model, optimizer, state, cfg["steps"], dist.new_group(backend="gloo"))
    root = os.path.join(base, "compare")
    methods = build_methods(root, rank, model, optimizer, state, job.group, job_name)
    walls: dict[str, float] = {}
    out: dict[str, Any] = {"rank": rank, "lazy": lazy_supported(), "methods": list(methods),
                           "state_bytes": jobs.tensor_bytes(jobs.local_tensors(state.tensor_state())),
                           "trainable_bytes": trainable_bytes(model, optimizer),
                           "trainable_global_bytes": trainable_global_bytes(model, optimizer)}
    kept = methods[OUR_EAGER if finetune else OUR_SYNC]
    assert isinstance(kept, OurSave)
    try:
        started = time.perf_counter()
        out["saves"] = measure_saves(job, methods, cfg["repeats"], cfg.get("lost_pairs") or cfg["repeats"])
        out["copy"] = copy_series(job, cfg["repeats"])
        out["floor"] = floor_series(job, cfg["repeats"])
        walls["saves"] = time.perf_counter() - started
        started = time.perf_counter()
        if finetune:
            out["restore"] = finetune_restore(job, methods, job.group, cfg["repeats"])
            out["restore_columns"] = {name: name for name in methods}
            out["small_state_bytes"] = small_state_bytes(kept.root)
        else:
            out["restore"] = measure_restore(kept.mgr, model, optimizer, generation_dcp_dir(kept.root)[1],
                                             job.group, cfg["repeats"],
                                             cold=cfg.get("restore_cache") != "warm")
            out["restore_columns"] = {"verified": OUR_SYNC, "dcp_load": DCP_SYNC}
        out["generation"] = generation_dcp_dir(kept.root)[0]
        walls["restore"] = time.perf_counter() - started
        if cfg.get("profile_cpu"):
            out["profile_cpu"] = profile_cpu(job, methods[OUR_EAGER])
    finally:
        for method in methods.values():
            method.close()
    jobs.barrier()
    if rank == 0:
        for method in methods.values():
            if isinstance(method, OurSave) and method is not kept:
                shutil.rmtree(method.root, ignore_errors=True)
    if finetune and cfg.get("mirror"):
        from .mirror import measure_mirror

        started = time.perf_counter()
        out["mirror"] = measure_mirror(root, cfg["mirror"], rank, state,
                                       lambda: jobs.train_step(model, optimizer))
        walls["mirror"] = time.perf_counter() - started
    out["sync_root"], out["walls"] = kept.root, walls
    return out


def rank_compare_reshard(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Verified ``restore()`` vs ``dcp.load`` at ``world`` ranks of the 2-rank generation."""
    torch.set_num_threads(1)
    model, optimizer, state = jobs.build_job_sized(cfg["state_mib"], rank, world, 2, cfg.get("kind", "fsdp"),
                                                   cfg.get("job", "full"))
    generation, dcp_dir = generation_dcp_dir(root)
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        times = measure_restore(mgr, model, optimizer, dcp_dir, None, cfg["repeats"],
                                cold=cfg.get("restore_cache") != "warm")
    columns = {"verified": OUR_EAGER, "dcp_load": DCP_ASYNC} if cfg.get("job") == "finetune" else \
        {"verified": OUR_SYNC, "dcp_load": DCP_SYNC}
    return {"rank": rank, "generation": generation, "restore": times, "restore_columns": columns}
