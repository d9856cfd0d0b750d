"""A/B of the compare phase's restore row alone: verified ``restore()`` against an unverified
``dcp.load`` + ``set_state_dict`` of the same generation, cold, 2 gloo ranks.

The job, the save and the timed calls are the compare phase's (``compare``: the FSDP2 + AdamW
job, our sync save with ``keep_last=2``, ``dcp_load``, ``time_restores`` with ``evict`` of the
generation's files before each call, one unmeasured warm-up each, then rounds in alternating
order), without the save measurements in front. Besides each call's wall time (slowest rank),
each rank's process CPU seconds (user and system, every thread: ``getrusage``) per call, since
on a shared machine wall time moves with the neighbours and CPU time less.

``--baseline-onepass PATH`` adds a third call to every round: the same ``restore()`` with the
one-pass reader of another ``onepass.py`` (for instance the one of an older commit, from ``git
show``), in the same processes. To compare whole library versions, run this module from each
checkout in turn instead (the figures of separate runs move with the machine's load).

Optional diagnostics after the timed rounds (not timed with them): ``--profile`` (cProfile of one
more cold call of each, rank 0, printed) and ``--timeline`` (one more cold verified restore and
one more ``dcp_load``, each rank's steps timestamped per thread: the one-pass reader's fetch,
hash, verdict and copies, the collectives, ``set_state_dict``; by wrapping those functions for
that call only). A diagnostic, not a test.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench.restore_ab [--state-mib 512] [--repeats 7] [--profile]
                                                 [--timeline] [--warm] [--dir DIR] [--json PATH]
                                                 [--baseline-onepass PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

RUN_TIMEOUT_S = 1800


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _metered(fn: Callable[[], Any], cpu: list[tuple[float, float]]) -> Callable[[], Any]:
    """``fn`` with the process CPU seconds (user, system) of each call appended to ``cpu``."""
    def call() -> None:
        user, system = _cpu()
        fn()
        user_after, system_after = _cpu()
        cpu.append((user_after - user, system_after - system))
    return call


@contextmanager
def _timeline(events: list[tuple[str, str, float, float]]) -> Iterator[None]:
    """The one-pass reader's steps, timestamped: (thread, step, start, end), perf_counter."""
    from torch.distributed.checkpoint import state_dict
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from dist_ckpt.protocol.comm import Comm
    from dist_ckpt.restore import onepass

    reader = onepass.OnePassReader
    targets = [(reader, name) for name in ("_fetch", "_verify", "read_data", "_load_items", "close")]
    from dist_ckpt.restart.state import TrainState
    from dist_ckpt.restore import loader, resume

    targets += [(Comm, "all_gather"), (Comm, "broadcast"), (FileSystemReader, "read_data"),
                (state_dict, "set_state_dict"), (state_dict, "get_state_dict"),
                (resume, "select_generation"), (resume, "load_generation"), (loader, "_dcp_load"),
                (loader, "agree_before_load"), (loader, "read_verified"), (loader, "check_layout"),
                (TrainState, "load_tensor_state"), (TrainState, "tensor_state")]
    originals = {(owner, name): getattr(owner, name) for owner, name in targets}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                label = name if name not in ("_fetch", "_verify") else f"{name} {args[1]}"
                if name == "read_data" and type(args[0]) is FileSystemReader:
                    label = "dcp read_data"
                events.append((threading.current_thread().name, label, started, time.perf_counter()))
        return wrapped

    for (owner, name), original in originals.items():
        setattr(owner, name, wrap(name, original))
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


def _with_reader(onepass_path: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with the restore using the one-pass reader of another ``onepass.py`` (the same
    package's other modules): the A/B of two versions of the reader in the same processes."""
    import importlib.util

    from dist_ckpt.restore import loader

    spec = importlib.util.spec_from_file_location("dist_ckpt.restore.onepass_baseline", onepass_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def call() -> Any:
        current = loader.OnePassReader, loader.own_shards
        loader.OnePassReader, loader.own_shards = module.OnePassReader, module.own_shards
        try:
            return fn()
        finally:
            loader.OnePassReader, loader.own_shards = current
    return call


def _profiled(fn: Callable[[], Any], lines: int = 30) -> str:
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def rank_ab(rank: int, world: int, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    """One rank: build the job, one sync save, then the alternated restores (and diagnostics)."""
    import torch
    import torch.distributed as dist

    from dist_ckpt import CheckpointConfig, CheckpointManager

    from . import jobs
    from .compare import dcp_load, generation_dcp_dir, time_restores
    from .rawio import evict

    torch.set_num_threads(1)
    model, optimizer, state = jobs.build_job(cfg["state_mib"], rank, world)
    group = dist.new_group(backend="gloo")
    root = os.path.join(base, "ours-sync")
    out: dict[str, Any] = {"rank": rank}
    with CheckpointManager(CheckpointConfig(root=root, keep_last=2, async_save=False), state) as mgr:
        for update in (1, 2):  # the compare phase restores a later generation of a used manager
            jobs.train_step(model, optimizer)
            mgr.save(update)
            mgr.wait()
        generation, path = generation_dcp_dir(root)
        generation_dir = os.path.dirname(os.path.normpath(path))
        cpu: dict[str, list[tuple[float, float]]] = {"verified": [], "dcp_load": []}
        steps = {"verified": _metered(mgr.restore, cpu["verified"]),
                 "dcp_load": _metered(lambda: dcp_load(model, optimizer, path, group), cpu["dcp_load"])}
        if cfg.get("baseline_onepass"):
            cpu["verified_base"] = []
            steps["verified_base"] = _metered(_with_reader(cfg["baseline_onepass"], mgr.restore),
                                              cpu["verified_base"])
        before = None if cfg["warm"] else (lambda: evict(generation_dir))
        out["wall"] = time_restores(steps, cfg["repeats"], before=before)
        out["cpu"] = {name: values[1:] for name, values in cpu.items()}  # the warm-up is not timed
        out["generation"] = generation
        if cfg["profile"]:
            for name, fn in (("verified", mgr.restore),
                             ("dcp_load", lambda: dcp_load(model, optimizer, path, group))):
                if before is not None:
                    before()
                jobs.barrier()
                text = _profiled(fn) if rank == 0 else (fn(), "")[1]
                if rank == 0:
                    out[f"profile_{name}"] = text
        if cfg["timeline"]:
            events: list[tuple[str, str, float, float]] = []
            if before is not None:
                before()
            jobs.barrier()
            started = time.perf_counter()
            with _timeline(events):
                mgr.restore()
            out["timeline"] = {"total": time.perf_counter() - started,
                               "events": [(t, s, a - started, b - started) for t, s, a, b in events]}
            events = []
            if before is not None:
                before()
            jobs.barrier()
            started = time.perf_counter()
            with _timeline(events):
                dcp_load(model, optimizer, path, group)
            out["timeline_dcp"] = {"total": time.perf_counter() - started,
                                   "events": [(t, s, a - started, b - started) for t, s, a, b in events]}
    return out


def report(ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Slowest rank per repetition (wall), each rank's CPU per call; printed and returned."""
    from . import jobs

    summary: dict[str, Any] = {"config": cfg, "generation": ranks[0]["generation"]}
    mode = "warm" if cfg["warm"] else "cold"
    print(f"restore A/B, {mode}, {len(ranks)} ranks, {cfg['state_mib']} MiB per rank, "
          f"{cfg['repeats']} rounds (alternated, after one warm-up each)")
    medians = {}
    names = [name for name in ("verified", "verified_base", "dcp_load") if name in ranks[0]["wall"]]
    for name in names:
        slowest = [max(r["wall"][name][i] for r in ranks) for i in range(cfg["repeats"])]
        q1, median, q3 = jobs.median_quartiles(slowest)
        medians[name] = median
        cpu_parts = []
        for r in ranks:
            users = [u for u, _ in r["cpu"][name]]
            systems = [s for _, s in r["cpu"][name]]
            totals = [u + s for u, s in r["cpu"][name]]
            cpu_parts.append(f"rank {r['rank']} cpu {statistics.median(totals):.3f} s "
                             f"(user {statistics.median(users):.3f}, sys {statistics.median(systems):.3f})")
        summary[name] = {"wall_slowest": slowest, "median": median, "q1": q1, "q3": q3,
                         "cpu": {r["rank"]: r["cpu"][name] for r in ranks}}
        print(f"  {name:9s} wall median {median:.3f} s (q1 {q1:.3f}, q3 {q3:.3f}); " + "; ".join(cpu_parts))
    ratios = [v / d for v, d in zip(summary["verified"]["wall_slowest"], summary["dcp_load"]["wall_slowest"],
                                    strict=True)]
    summary["ratio_median"] = medians["verified"] / medians["dcp_load"]
    summary["ratio_per_round_median"] = statistics.median(ratios)
    print(f"  verified / dcp_load: {summary['ratio_median']:.3f} (medians), "
          f"per-round median {summary['ratio_per_round_median']:.3f}")
    if "verified_base" in medians:
        base = [v / d for v, d in zip(summary["verified_base"]["wall_slowest"],
                                      summary["dcp_load"]["wall_slowest"], strict=True)]
        summary["base_ratio_median"] = medians["verified_base"] / medians["dcp_load"]
        print(f"  verified_base / dcp_load: {summary['base_ratio_median']:.3f} (medians), "
              f"per-round median {statistics.median(base):.3f}")
    for name in ("profile_verified", "profile_dcp_load"):
        if name in ranks[0]:
            print(f"--- rank 0 cProfile, {name[8:]} ---\n{ranks[0][name]}")
    for key, what in (("timeline", "verified restore"), ("timeline_dcp", "dcp_load")):
        for rank in ranks:
            if key not in rank:
                continue
            line = rank[key]
            print(f"--- rank {rank['rank']} timeline of one {what} ({line['total']:.3f} s) ---")
            for thread, step, start, end in sorted(line["events"], key=lambda e: e[2]):
                print(f"  {start:7.3f} .. {end:7.3f}  {end - start:6.3f}  {thread:28s} {step}")
            summary[f"{key}_rank{rank['rank']}"] = line
    return summary


def main(argv: list[str] | None = None) -> None:
    from .runner import rank_environment

    parser = argparse.ArgumentParser(prog="python -m scripts.bench.restore_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warm", action="store_true", help="keep the files in the page cache")
    parser.add_argument("--profile", action="store_true", help="cProfile one more call of each, rank 0")
    parser.add_argument("--timeline", action="store_true", help="timestamp one more verified restore")
    parser.add_argument("--dir", default=None, help="where the generation is written (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--baseline-onepass", default=None, metavar="PATH",
                        help="another version of dist_ckpt/restore/onepass.py: its restore is timed too "
                             "(verified_base), alternated with the others in the same processes")
    args = parser.parse_args(argv)
    cfg = {"state_mib": args.state_mib, "repeats": args.repeats, "warm": args.warm,
           "profile": args.profile, "timeline": args.timeline, "allocator": "caching",
           "baseline_onepass": args.baseline_onepass and os.path.abspath(args.baseline_onepass)}
    from . import jobs

    jobs.run_two_ranks(rank_ab, cfg, report, environment=rank_environment(cfg), prefix="restore-ab-",
                       timeout_s=RUN_TIMEOUT_S, parent=args.dir, json_path=args.json)


if __name__ == "__main__":
    # the rank function must live in the same module in the spawned ranks: ``bench.restore_ab``
    # (scripts/ on the path), as ``python -m scripts.bench`` arranges for its own
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.restore_ab import main as bench_main

    bench_main()
