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
``restore()`` does too), alternated, both after one unmeasured warm-up each and with nothing
dropped from the page cache (same conditions for both). A second, 3-rank run does the same on
the 2-rank generation (reshard).
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs
from .compare_methods import OUR_EAGER, OUR_SYNC, Method, OurSave, build_methods, dcp_state, lazy_supported


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
        standalone(job, method, {key: [] for key in SERIES})
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
                    path: str, group: dist.ProcessGroup | None, repeats: int) -> dict[str, list[float]]:
    """Verified ``restore()`` vs unverified ``dcp.load`` of the same files, alternated, warm."""
    def load() -> None:
        dcp_load(model, optimizer, path, group)

    steps = {"verified": mgr.restore, "dcp_load": load}
    for fn in steps.values():  # warm-up: page cache and first-call costs, the same for both
        jobs.barrier()
        fn()
    out: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(repeats):
        for name in list(steps) if index % 2 == 0 else reversed(list(steps)):
            jobs.barrier()
            out[name].append(jobs.timed(steps[name]))
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
    """One rank of the 2-rank compare run; leaves the sync root for the reshard run."""
    torch.set_num_threads(1)
    model, optimizer, state = jobs.build_job(cfg["state_mib"], rank, world, cfg.get("kind", "fsdp"),
                                             cfg.get("job", "full"))
    job = Job(rank, model, optimizer, state, cfg["steps"], dist.new_group(backend="gloo"))
    root = os.path.join(base, "compare")
    methods = build_methods(root, rank, model, optimizer, state, job.group)
    walls: dict[str, float] = {}
    out: dict[str, Any] = {"rank": rank, "lazy": lazy_supported(), "methods": list(methods),
                           "state_bytes": jobs.tensor_bytes(jobs.local_tensors(state.tensor_state())),
                           "trainable_bytes": trainable_bytes(model, optimizer)}
    sync = methods[OUR_SYNC]
    assert isinstance(sync, OurSave)
    try:
        started = time.perf_counter()
        out["saves"] = measure_saves(job, methods, cfg["repeats"], cfg.get("lost_pairs") or cfg["repeats"])
        out["copy"] = copy_series(job, cfg["repeats"])
        walls["saves"] = time.perf_counter() - started
        out["generation"], dcp_dir = generation_dcp_dir(sync.root)
        started = time.perf_counter()
        out["restore"] = measure_restore(sync.mgr, model, optimizer, dcp_dir, job.group, cfg["repeats"])
        walls["restore"] = time.perf_counter() - started
        if cfg.get("profile_cpu"):
            out["profile_cpu"] = profile_cpu(job, methods[OUR_EAGER])
    finally:
        for method in methods.values():
            method.close()
    jobs.barrier()
    if rank == 0:
        for method in methods.values():
            if isinstance(method, OurSave) and method is not sync:
                shutil.rmtree(method.root, ignore_errors=True)
    out["sync_root"], out["walls"] = sync.root, walls
    return out


def rank_compare_reshard(rank: int, world: int, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """Verified ``restore()`` vs ``dcp.load`` at ``world`` ranks of the 2-rank generation."""
    torch.set_num_threads(1)
    model, optimizer, state = jobs.build_job_sized(cfg["state_mib"], rank, world, 2, cfg.get("kind", "fsdp"),
                                                   cfg.get("job", "full"))
    generation, dcp_dir = generation_dcp_dir(root)
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        times = measure_restore(mgr, model, optimizer, dcp_dir, None, cfg["repeats"])
    return {"rank": rank, "generation": generation, "restore": times}
