"""Blocking time of an async save vs a sync save vs a plain in-memory copy (2 gloo ranks).

Usage: .venv/bin/python scripts/bench_async.py [--state-mib 256] [--repeats 5] [--dir DIR]
Prints medians (and min/max) per rank-0 and the two ratios; not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench import jobs  # noqa: E402


def measure(rank: int, world: int, state_mib: int, repeats: int, base: str) -> dict:
    import torch

    from dist_ckpt import CheckpointConfig, CheckpointManager

    torch.set_num_threads(1)
    model, optimizer, state = jobs.build_job(state_mib, rank, world)
    tensors = jobs.local_tensors(state.tensor_state())
    buffers = [torch.empty_like(t) for t in tensors]
    jobs.copy_floor(tensors, buffers)  # first touch of the buffers is not the floor
    out: dict = {"state_bytes": sum(t.numel() * t.element_size() for t in tensors), "copy": [],
                 "async": [], "sync": []}
    for mode in ("async", "sync"):
        root = os.path.join(base, mode)
        config = CheckpointConfig(root=root, async_save=mode == "async", keep_last=2)
        with CheckpointManager(config, state) as mgr:
            for update in range(1, repeats + 2):
                jobs.train_step(model, optimizer)
                jobs.barrier()
                seconds = jobs.timed(lambda u=update: mgr.save(u))
                if update == 1:
                    out[f"{mode}_first"] = seconds
                else:
                    out[mode].append(seconds)
                mgr.wait()
                out["copy"].append(jobs.copy_floor(tensors, buffers))
        jobs.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    from dist_ckpt.testing import run_ranks

    base = tempfile.mkdtemp(prefix="bench-async-", dir=args.dir)
    try:
        results = run_ranks(2, measure, args.state_mib, args.repeats, base, timeout_s=1800)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(jobs.machine())
    for rank, result in enumerate(results):
        stats = {k: jobs.summary(result[k]) for k in ("async", "sync", "copy")}
        print(f"rank {rank}: state {result['state_bytes'] / jobs.MiB:.0f} MiB; first save "
              f"async {result['async_first']:.3f} s, sync {result['sync_first']:.3f} s")
        for key, value in stats.items():
            print(f"  {key:5s} blocking median {value['median']:.4f} s "
                  f"(min {value['min']:.4f}, max {value['max']:.4f}, n={value['n']})")
        print(f"  async/sync = {stats['async']['median'] / stats['sync']['median']:.3f}; "
              f"async/copy = {stats['async']['median'] / stats['copy']['median']:.3f}")


if __name__ == "__main__":
    main()
