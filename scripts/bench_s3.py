"""Upload throughput to S3: dist_ckpt against a plain s3fs put of the same bytes (one run).

Two figures, each the median of --repeats:
- upload: the files of one generation (written once to a local root) uploaded and verified by
  the object-store tier, with ``upload_verification="checksum"`` (CRC32C sent with each body,
  one HEAD) and ``"readback"`` (each object downloaded and hashed again), against plain
  ``s3fs.put_file`` of the same files with the same number of uploads in flight;
- save: a whole ``save()`` to an ``s3://`` root (write, digest, upload, verify, manifest)
  against one plain s3fs put of the same bytes as a single object.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench import jobs  # noqa: E402

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.format.validate import read_manifest
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.storage.objectstore import ObjectStore
from dist_ckpt.tiers.objectstore import upload_files

CONCURRENCY = 4  # the tier's default uploads in flight per rank


def generation_files(backend: ObjectStore, name: str) -> list[tuple[str, int]]:
    return [(p, int(backend.fs.info(p)["size"])) for p in backend.fs.find(f"{backend.base}/{name}")]


def make_state(state_mib: int) -> TrainState:
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False)
                                  for _ in range(max(1, state_mib // 4))])
    return TrainState(model, require_optimizer_boundary=False)


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure_upload(root: str, scratch: str, state_mib: int, repeats: int) -> dict:
    """The upload phase alone: the same local files, three ways."""
    local_root = os.path.join(scratch, "local")
    with CheckpointManager(CheckpointConfig(root=local_root), make_state(state_mib)) as mgr:
        mgr.save(1)
    name = "gen-000000000001"
    gen_dir = os.path.join(local_root, name)
    entries = [f.model_dump(exclude_none=True) for f in read_manifest(LocalStore(local_root), name).files]
    stores = {"checksum": ObjectStore(root, checksums=True),
              "readback": ObjectStore(root, checksums=False)}
    plain_fs = stores["readback"].fs

    def plain(prefix: str) -> None:
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            list(pool.map(lambda e: plain_fs.put_file(os.path.join(gen_dir, e["path"]),
                                                      f"{stores['readback'].base}/{prefix}/{e['path']}"),
                          entries))

    runs: dict[str, Callable[[str], None]] = {
        "plain": plain,
        **{mode: (lambda prefix, store=store: upload_files(store, gen_dir, prefix, entries,
                                                           concurrency=CONCURRENCY))
           for mode, store in stores.items()}}
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for repeat in range(repeats):
        order = list(runs)[repeat % len(runs):] + list(runs)[:repeat % len(runs)]  # rotate: no fixed order
        for mode in order:
            prefix = f"upload/{repeat}/{mode}"
            times[mode].append(timed(lambda: runs[mode](prefix)))  # noqa: B023 - called at once
            stores["readback"].remove_tree(prefix)
    return {"bytes": sum(e["size"] for e in entries), "files": len(entries), **times}


def measure_save(root: str, scratch: str, state_mib: int, repeats: int) -> dict:
    ours, plain = [], []
    with CheckpointManager(CheckpointConfig(root=root, cache_dir=scratch, keep_last=2),
                           make_state(state_mib)) as mgr:
        backend = ObjectStore(root)
        for update in range(1, repeats + 1):
            ours.append(timed(lambda: mgr.save(update)))  # noqa: B023 - called at once
            files = generation_files(backend, f"gen-{update:012d}")
            total = sum(size for _, size in files)
            local = os.path.join(scratch, "plain.bin")
            with open(local, "wb") as handle:  # the same bytes as one object
                for path, _ in files:
                    handle.write(backend.fs.cat_file(path))
            key = f"{backend.base}/plain/{update}.bin"
            plain.append(timed(lambda: backend.fs.put_file(local, key)))  # noqa: B023 - called at once
            backend.fs.rm(key)
    return {"bytes": total, "ours": ours, "plain": plain}


def line(label: str, mib: float, times: list[float]) -> str:
    median = statistics.median(times)
    return (f"{label}: median {median:.3f} s = {mib / median:.1f} MiB/s "
            f"(min {min(times):.3f}, max {max(times):.3f})")


def report(upload: dict, save: dict, repeats: int) -> None:
    print(jobs.machine())
    mib = upload["bytes"] / jobs.MiB
    print(f"upload of one generation's files: {mib:.1f} MiB in {upload['files']} files, {CONCURRENCY} "
          f"in flight, {repeats} repeats")
    print("  " + line("plain s3fs put_file", mib, upload["plain"]))
    print("  " + line("dist_ckpt checksum (CRC32C with each body, one HEAD)", mib, upload["checksum"]))
    print("  " + line("dist_ckpt readback (HEAD, download and hash)", mib, upload["readback"]))
    plain = statistics.median(upload["plain"])
    for mode in ("checksum", "readback"):
        print(f"  throughput ratio {mode} / plain put = {plain / statistics.median(upload[mode]):.3f}")
    mib = save["bytes"] / jobs.MiB
    print(f"whole save of a {mib:.1f} MiB generation to s3:// (write, blake3, upload, checksum verify, "
          "manifest)")
    print("  " + line("dist_ckpt save()", mib, save["ours"]))
    print("  " + line("plain s3fs put_file of the same bytes as one object", mib, save["plain"]))
    print(f"  throughput ratio save / plain put = "
          f"{statistics.median(save['plain']) / statistics.median(save['ours']):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--external", action="store_true", help="use AWS_ENDPOINT_URL as is")
    args = parser.parse_args()

    def run() -> tuple[dict, dict]:
        from tests.helpers.s3 import new_bucket

        root = f"s3://{new_bucket()}/bench"
        with tempfile.TemporaryDirectory() as scratch:
            upload = measure_upload(root, scratch, args.state_mib, args.repeats)
            return upload, measure_save(root, scratch, args.state_mib, args.repeats)

    if args.external:
        upload, save = run()
    else:
        from tests.helpers.s3 import moto_endpoint

        with moto_endpoint():
            upload, save = run()
    print(f"endpoint: {'AWS_ENDPOINT_URL' if args.external else 'moto_server on loopback'}")
    report(upload, save, args.repeats)


if __name__ == "__main__":
    main()
