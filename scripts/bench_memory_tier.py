"""Memory tier vs disk only, on one job (2 gloo ranks, FSDP2, AdamW, async saves).

    python scripts/bench_memory_tier.py --mib 64 --steps 8

Per configuration (a save after every update): the blocking time of ``save()`` against a copy
of the same bytes into preallocated memory (issue 14's target: at most 1.5x), timed right before
each save (same moment, same load; the median) and, separately, as the best of 3 copies after
the run, with the rank's peer copying at once; and the training
time lost per checkpoint (steps with a save each minus steps without, per step). Then the
time to resume the final generation (``restore()``, then the first update) from the memory
tier against the disk root (it is in both when ``--steps`` is a multiple of
``--persist-every``; the disk root's files are dropped from the page cache first with
POSIX_FADV_DONTNEED, as on a cold node). ``--mib`` is the state per rank (parameters + two Adam
moments). Prints one table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState, runinfo  # noqa: E402
from dist_ckpt.memory import paths as shm  # noqa: E402
from dist_ckpt.save.staging import local_tensors  # noqa: E402
from dist_ckpt.testing import run_ranks  # noqa: E402
from scripts.bench.rawio import evict  # noqa: E402

WIDTH = 1024


def build(mib: int) -> tuple[TrainState, torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # parameters + two moments = 3 x the rank's half of the parameters
    layers = max(1, round(mib * (1 << 20) * 2 / 3 / 4 / (WIDTH * WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return TrainState(model, optimizer, contract={"bench": "memory"}), model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class CopyTarget:
    """Preallocated buffers for the rank's tensors; ``copy()`` times one copy into them."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.targets = [torch.empty_like(t) for t in local_tensors(state.tensor_state())]

    def copy(self) -> float:
        live = local_tensors(self.state.tensor_state())
        began = time.perf_counter()
        for target, source in zip(self.targets, live, strict=True):
            target.copy_(source)
        return time.perf_counter() - began


def copy_baseline(state: TrainState, repeats: int = 3) -> float:
    """A copy of the rank's tensors into preallocated memory (best of ``repeats``)."""
    spare = CopyTarget(state)
    return min(spare.copy() for _ in range(repeats))


def job(rank: int, world: int, root: str, shm_dir: str, memory: bool, mib: int, steps: int,
        persist_every: int, snapshot: str = "eager") -> dict:
    os.environ[shm.SHM_DIR_ENV] = shm_dir
    os.environ[runinfo.RUN_ID_ENV] = "bench"
    state, model, optimizer = build(mib)
    config = CheckpointConfig(root=root, async_save=True, memory_tier=memory,
                              persist_every=persist_every, keep_last=2, check_free_space=False,
                              snapshot=snapshot)
    for _ in range(2):  # warm-up: allocator, first-touch of the optimizer state
        step(model, optimizer)
    began = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer)
    plain_s = (time.perf_counter() - began) / steps
    blocking, queued, copies = [], [], []
    with CheckpointManager(config, state) as mgr:
        spare = CopyTarget(state)
        saving_s = 0.0
        for update in range(1, steps + 1):
            began = time.perf_counter()
            step(model, optimizer)
            saving_s += time.perf_counter() - began
            # the same bytes copied into preallocated memory just before save() (not in the
            # step's timing): the copy save() is held to, under the same load as its own
            copies.append(spare.copy())
            # an earlier save still in flight here: save() waits for it (the in-flight bound)
            queued.append(any(not job.done.is_set() for job in mgr.inflight.jobs))
            started = time.perf_counter()
            mgr.save(update)
            blocking.append(time.perf_counter() - started)
            saving_s += time.perf_counter() - started
        mgr.wait()
    free = [b for b, q in zip(blocking[1:], queued[1:], strict=True) if not q]
    return {"blocking_s": statistics.median(blocking[1:]), "lost_s": saving_s / steps - plain_s,
            "free_blocking_s": statistics.median(free) if free else float("nan"),
            "queued": sum(queued[1:]), "copy_s": copy_baseline(state),
            "copy_loop_s": statistics.median(copies[1:]), "step_s": plain_s}


def resume(rank: int, world: int, root: str, shm_dir: str, memory: bool, mib: int) -> dict:
    os.environ[shm.SHM_DIR_ENV] = shm_dir
    os.environ[runinfo.RUN_ID_ENV] = "bench"
    state, model, optimizer = build(mib)
    config = CheckpointConfig(root=root, memory_tier=memory, check_free_space=False)
    with CheckpointManager(config, state) as mgr:
        began = time.perf_counter()
        result = mgr.restore()
        restored = time.perf_counter()
        step(model, optimizer)
        return {"resume_s": time.perf_counter() - began, "restore_s": restored - began,
                "tier": result.tier, "generation": result.generation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="state per rank in MiB")
    parser.add_argument("--steps", type=int, default=8, help="updates (one save each) per run")
    parser.add_argument("--persist-every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="resume measurements per tier")
    parser.add_argument("--disk-dir", default=os.getcwd(), help="where the disk roots go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk, \
            tempfile.TemporaryDirectory(prefix="bench-shm-", dir=shm.DEFAULT_BASE) as shm_dir:
        rows = {}
        for name, memory, snapshot in (("disk only", False, "eager"), ("memory tier", True, "eager"),
                                       ("memory tier, lazy", True, "lazy")):
            root = os.path.join(disk, name.replace(" ", "-").replace(",", ""))
            ranks = run_ranks(2, job, root, shm_dir, memory, args.mib, args.steps,
                              args.persist_every, snapshot, timeout_s=600)
            rows[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}
        print(f"state per rank {args.mib} MiB, {args.steps} updates, a save after each (2 gloo ranks)")
        print("| configuration | save() blocking | copy, same moment | ratio | copy, best of 3 "
              "after | ratio | blocking, no save in flight | saves that found one in flight | "
              "step | lost per checkpoint |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, row in rows.items():
            print(f"| {name} | {row['blocking_s'] * 1e3:.1f} ms | {row['copy_loop_s'] * 1e3:.1f} ms | "
                  f"{row['blocking_s'] / row['copy_loop_s']:.2f}x | {row['copy_s'] * 1e3:.1f} ms | "
                  f"{row['blocking_s'] / row['copy_s']:.2f}x | {row['free_blocking_s'] * 1e3:.1f} ms | "
                  f"{row['queued']} of {args.steps - 1} | {row['step_s'] * 1e3:.1f} ms | "
                  f"{row['lost_s'] * 1e3:.1f} ms |")
        # the final generation of the memory-tier run: persisted when steps % persist_every == 0
        root = os.path.join(disk, "memory-tier")  # the eager run's
        series: dict[str, dict[str, list[float]]] = {
            name: {"resume_s": [], "restore_s": []} for name in ("disk", "memory")}
        for index in range(args.repeats):  # alternated: drift hits both alike
            order = (("disk", False), ("memory", True))
            for name, memory in order if index % 2 == 0 else order[::-1]:
                evict(root)
                ranks = run_ranks(2, resume, root, shm_dir, memory, args.mib, timeout_s=600)
                for key in series[name]:
                    series[name][key].append(max(r[key] for r in ranks))
                tier, generation = ranks[0]["tier"], ranks[0]["generation"]
                assert tier == ("memory" if memory else "local"), (name, tier)
        times = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in series.items()}
        for name, median in times.items():
            print(f"resume from the {name} tier ({generation}), median of {args.repeats}: restore "
                  f"{median['restore_s']:.3f} s, restore + first update {median['resume_s']:.3f} s")
        for key, what in (("restore_s", "restore"), ("resume_s", "restore + first update")):
            print(f"memory / disk, {what}: {times['memory'][key] / times['disk'][key]:.2f}x "
                  "(goal < 0.5x)")


if __name__ == "__main__":
    main()
