"""Peak memory of `dist_ckpt.export`: build a >= 1 GiB generation (one process), export it in
a child process and report the child's peak RSS against the largest tensor plus one shard.

    .venv/bin/python scripts/export_memory.py [--layers 16] [--width 4096] [--max-shard-size 256MiB]

The peak RSS of each child is its VmHWM, read by the child itself just before it exits: Linux
carries the parent's RSS at fork into a child's ru_maxrss (getrusage / wait4), so that would
count the generation this process built; VmHWM belongs to the address space exec creates.
The baseline is a child that only imports torch and dist_ckpt.export.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.cli.export import size_arg

MIB = 1 << 20


def build_generation(root: str, layers: int, width: int) -> tuple[int, int]:
    """Save a model of ``layers`` float32 width x width Linear layers; return (total bytes of
    model tensors, largest tensor bytes)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    with CheckpointManager(CheckpointConfig(root=root), TrainState(model)) as mgr:
        mgr.save(1)
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    return sum(sizes), max(sizes)


REPORT_HWM = ("\nfor line in open('/proc/self/status'):\n"
              "    if line.startswith('VmHWM:'): print('HWM', int(line.split()[1]) * 1024)")


def child_peak_rss(code: str) -> tuple[int, float]:
    """Run ``python -c code``; return its peak RSS (VmHWM) in bytes and its wall time."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code + REPORT_HWM], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child failed with exit status {done.returncode}: {done.stderr[-2000:]}")
    hwm = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("HWM "))
    return hwm, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--max-shard-size", type=size_arg, default=256 * MIB)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="export-memory-") as scratch:
        root, out = os.path.join(scratch, "root"), os.path.join(scratch, "release")
        total, largest = build_generation(root, args.layers, args.width)
        baseline, _ = child_peak_rss("import torch, dist_ckpt.export")
        peak, seconds = child_peak_rss(
            f"from dist_ckpt.export import export_generation; "
            f"export_generation({root!r}, {out!r}, max_shard_bytes={args.max_shard_size})")
        shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
        bound = largest + args.max_shard_size
        print(f"model tensors          {total / MIB:.1f} MiB in {args.layers} Linear({args.width}, "
              f"{args.width}) layers (float32)")
        print(f"export                 {len(shards)} shards in {seconds:.1f} s")
        print(f"peak RSS (export)      {peak / MIB:.1f} MiB")
        print(f"baseline RSS (import)  {baseline / MIB:.1f} MiB (python + torch + dist_ckpt.export)")
        print(f"largest tensor         {largest / MIB:.1f} MiB")
        print(f"output shard size      {args.max_shard_size / MIB:.1f} MiB (--max-shard-size)")
        print(f"ratio peak / (largest + shard)               {peak / bound:.2f}")
        print(f"ratio (peak - baseline) / (largest + shard)  {(peak - baseline) / bound:.2f}")
        print(f"ratio peak / model size                      {peak / total:.2f}")


if __name__ == "__main__":
    main()
