"""Upload throughput of a generation to S3 vs a plain s3fs put of the same bytes (one run).

Starts its own moto_server on 127.0.0.1 (or uses AWS_ENDPOINT_URL when --external is given).
Usage: .venv/bin/python scripts/bench_s3.py [--state-mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench import jobs  # noqa: E402

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.storage.objectstore import ObjectStoreBackend


def generation_files(backend: ObjectStoreBackend, name: str) -> list[tuple[str, int]]:
    return [(p, int(backend.fs.info(p)["size"])) for p in backend.fs.find(f"{backend.base}/{name}")]


def measure(state_mib: int, repeats: int) -> dict:
    from tests.helpers.s3 import new_bucket

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False)
                                  for _ in range(max(1, state_mib // 4))])
    bucket = new_bucket()
    root = f"s3://{bucket}/bench"
    ours, plain = [], []
    with tempfile.TemporaryDirectory() as scratch, \
            CheckpointManager(CheckpointConfig(root=root, cache_dir=scratch, keep_last=2),
                              TrainState(model, require_optimizer_boundary=False)) as mgr:
        backend = ObjectStoreBackend(root)
        for update in range(1, repeats + 1):
            started = time.perf_counter()
            mgr.save(update)
            ours.append(time.perf_counter() - started)
            files = generation_files(backend, f"gen-{update:012d}")
            total = sum(size for _, size in files)
            local = os.path.join(scratch, "plain.bin")
            with open(local, "wb") as handle:  # the same bytes as one object per file
                for path, _ in files:
                    handle.write(backend.fs.cat_file(path))
            started = time.perf_counter()
            backend.fs.put_file(local, f"{backend.base}/plain/{update}.bin")
            plain.append(time.perf_counter() - started)
            backend.fs.rm(f"{backend.base}/plain/{update}.bin")
    return {"bytes": total, "ours": ours, "plain": plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--external", action="store_true", help="use AWS_ENDPOINT_URL as is")
    args = parser.parse_args()
    if args.external:
        result = measure(args.state_mib, args.repeats)
    else:
        from tests.helpers.s3 import moto_endpoint

        with moto_endpoint():
            result = measure(args.state_mib, args.repeats)
    mib = result["bytes"] / jobs.MiB
    ours, plain = statistics.median(result["ours"]), statistics.median(result["plain"])
    print(jobs.machine())
    print(f"generation: {mib:.1f} MiB, {args.repeats} repeats, endpoint moto_server on loopback")
    print(f"dist_ckpt save to s3:// (write, sha256, upload, read-back verify, manifest): "
          f"median {ours:.3f} s = {mib / ours:.1f} MiB/s (min {min(result['ours']):.3f}, "
          f"max {max(result['ours']):.3f})")
    print(f"plain s3fs put_file of the same bytes: median {plain:.3f} s = {mib / plain:.1f} MiB/s "
          f"(min {min(result['plain']):.3f}, max {max(result['plain']):.3f})")
    print(f"throughput ratio dist_ckpt / plain put = {plain / ours:.3f}")


if __name__ == "__main__":
    main()
