"""The compare phase's training-time-lost row alone, for our async methods (a diagnostic, not a test).

The job, the methods and the pairs are the compare phase's (``compare``: the FSDP2 + AdamW job,
``build_methods``' lazy / eager ``OurSave``, ``measure_saves``' warm-up and first save of each,
then ``lost_pair``: ``--steps`` train steps with one save started before the first and waited
for after the last, minus as many without, adjacent, order alternated; methods in alternated
order per round), with no standalone save measured between the pairs. 2 gloo ranks with the
compare phase's default 'caching' allocator environment; each pair's value is the slowest rank's.

It measures whatever ``dist_ckpt`` comes first on ``PYTHONPATH`` (``python -m`` puts the working
directory in front of ``PYTHONPATH``; this module moves ``PYTHONPATH``'s entries back in front),
so an older checkout can be measured with today's bench:

    git worktree add /tmp/old 3912524
    PYTHONPATH=/tmp/old .venv/bin/python -m scripts.bench.lost_ab --pairs 8

The ranks start as the imported library's ``dist_ckpt.testing.run_ranks`` starts them (a fork
server where it has one, else spawn); ``--start spawn`` asks a library with a fork server for
fresh interpreters instead (``DIST_CKPT_RANK_START``).

Usage (from the repository root):
    .venv/bin/python -m scripts.bench.lost_ab [--state-mib 512] [--steps 4] [--pairs 8]
                                              [--methods lazy,eager] [--start spawn] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any
from unittest import mock

RUN_TIMEOUT_S = 3600
METHODS = {"lazy": "dist_ckpt async lazy", "eager": "dist_ckpt async eager"}
# runner.CACHING_MALLOC_ENV (the compare phase's default allocator, 'caching'), not imported from
# there: runner imports every phase, and some of them modules an older library lacks
CACHING_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def foreign_modules(library: str) -> list[str]:
    """Loaded ``dist_ckpt`` modules from outside ``library``'s package directory: the editable
    install's finder supplies, from the working copy, any module an older checkout lacks."""
    root = os.path.dirname(library)
    return sorted(name for name, module in sys.modules.items()
                  if name.split(".")[0] == "dist_ckpt" and getattr(module, "__file__", None)
                  and not os.path.abspath(module.__file__).startswith(root + os.sep))


def rank_lost(rank: int, world: int, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    """One rank: the compare phase's job and methods, then only the lost pairs."""
    import torch
    import torch.distributed as dist

    import dist_ckpt

    from . import jobs
    from .compare import Job, measure_saves
    from .compare_methods import build_methods

    torch.set_num_threads(1)
    model, optimizer, state = jobs.build_job(cfg["state_mib"], rank, world)
    job = Job(rank, model, optimizer, state, cfg["steps"], dist.new_group(backend="gloo"))
    built = build_methods(os.path.join(base, "compare"), rank, model, optimizer, state, job.group)
    wanted = [METHODS[name] for name in cfg["methods"]]
    missing = [name for name in wanted if name not in built]
    if missing:
        raise SystemExit(f"this dist_ckpt ({dist_ckpt.__file__}) has no {missing}")
    methods = {name: built[name] for name in wanted}
    try:
        saves = measure_saves(job, methods, 0, cfg["pairs"])
    finally:
        for method in built.values():
            method.close()
    return {"rank": rank, "library": dist_ckpt.__file__, "saves": saves,
            "foreign": foreign_modules(dist_ckpt.__file__)}


def report(ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per method, each pair's slowest-rank time lost; median and quartiles. Printed and returned."""
    from . import jobs

    summary: dict[str, Any] = {"config": cfg, "library": ranks[0]["library"]}
    for rank in ranks:
        if rank["foreign"]:
            print(f"WARNING: rank {rank['rank']} loaded dist_ckpt modules from elsewhere: {rank['foreign']}")
    print(f"time lost per checkpoint, {ranks[0]['library']}: {len(ranks)} ranks, {cfg['state_mib']} MiB "
          f"per rank, {cfg['steps']} steps, {cfg['pairs']} pairs per method (start {cfg['start']})")
    for short in cfg["methods"]:
        name = METHODS[short]
        series = [r["saves"][name] for r in ranks]
        lost = [max(values) for values in zip(*(s["lost"] for s in series), strict=True)]
        without = [max(values) for values in zip(*(s["steps_without"] for s in series), strict=True)]
        q1, median, q3 = jobs.median_quartiles(lost)
        summary[short] = {"lost": lost, "median": median, "q1": q1, "q3": q3, "steps_without": without,
                          "per_rank": {r["rank"]: r["saves"][name] for r in ranks}}
        print(f"  {short:5s} median {median:6.3f} s (q1 {q1:6.3f}, q3 {q3:6.3f}); pairs: "
              + " ".join(f"{v:.2f}" for v in lost)
              + f"; steps without: median {statistics.median(without):.2f} s")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.lost_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--methods", default="lazy,eager", help="comma-separated: lazy, eager")
    parser.add_argument("--start", choices=("library", "spawn"), default="library",
                        help="how ranks start: as the library's run_ranks does, or fresh interpreters")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods):
        parser.error(f"--methods: a comma-separated subset of {', '.join(METHODS)}")
    cfg = {"state_mib": args.state_mib, "steps": args.steps, "pairs": args.pairs, "methods": methods,
           "start": args.start, "allocator": "caching"}
    if args.start == "spawn":
        os.environ["DIST_CKPT_RANK_START"] = "spawn"

    from . import jobs

    # the ranks read the allocator's settings at start
    jobs.run_two_ranks(rank_lost, cfg, report, environment=mock.patch.dict(os.environ, CACHING_MALLOC_ENV),
                       prefix="lost-ab-", timeout_s=RUN_TIMEOUT_S, json_path=args.json)


if __name__ == "__main__":
    # PYTHONPATH's checkout before the working directory's (``python -m`` puts the latter first),
    # so that its dist_ckpt is the one measured; then scripts/ in front, so that the rank function
    # lives in the same module (``bench.lost_ab``) in the spawned ranks, as ``python -m
    # scripts.bench`` arranges for its own (spawned ranks get this sys.path)
    front = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = front + [p for p in sys.path if os.path.abspath(p or ".") not in front]
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import lost_ab

    # a spawned rank imports the main module by name, and ``scripts.bench`` there would be the
    # PYTHONPATH checkout's (which may lack this module): name it ``bench.lost_ab`` instead
    __spec__ = lost_ab.__spec__  # noqa: A001
    lost_ab.main()
