"""Mirror bytes uploaded (the fine-tuning compare, issue 28): a moto S3 server on 127.0.0.1 and
the count of what each generation's mirror upload put into it.

Call order: the parent process enters :func:`moto_server` (``runner``) around the compare runs;
it starts a moto server on a port the kernel chose, creates one bucket and
exports the endpoint and test credentials, so the spawned ranks inherit them. Each rank of
the 2-rank compare run then calls :func:`measure_mirror` once per mode (all ranks: collective
saves), after the timed rounds, so that no upload runs beside a timed save.

Uploaded bytes are counted from the bucket's listing, not from the library: before and after
each generation's upload, rank 0 lists the mode's prefix; every key that is new, or whose
size, ETag or modification time changed (``latest.json`` is replaced each time), counts its
size. Deletions by the mirror's retention (``mirror_keep_last=2``, which bounds moto's
memory) do not count.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import jobs

DRAIN_TIMEOUT_S = 600.0  # one generation's upload (a full 1 GiB generation to moto takes seconds)
GENERATIONS = 3  # per mode: the first (every object new) and two measured ones
MODES = {"incremental": True, "full": False}  # mode -> CheckpointConfig.incremental


@contextmanager
def moto_server() -> Iterator[str | None]:
    """Parent process: a moto S3 server (``tests.helpers.s3``) with one fresh bucket, the
    environment pointing at it; yields ``s3://<bucket>``, or None when moto is not installed
    (no mirror row). The server stops on exit, every wait bounded."""
    from tests.helpers.s3 import moto_available, moto_endpoint, new_bucket

    if not moto_available():
        yield None
        return
    with moto_endpoint():
        yield f"s3://{new_bucket('bench')}"


def s3fs_filesystem() -> Any:
    """A fresh s3fs filesystem (no cached instance, so no cached listing)."""
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True)


Listing = dict[str, tuple[int, str, str]]  # key -> (size, ETag, LastModified)


def listing(url: str) -> Listing:
    """Every object below ``url`` (``s3://bucket/prefix``), with what identifies its version."""
    fs = s3fs_filesystem()
    path = url.removeprefix("s3://")
    try:
        found = fs.find(path, detail=True)
    except FileNotFoundError:
        return {}
    return {key: (int(info.get("size") or 0), str(info.get("ETag", "")), str(info.get("LastModified", "")))
            for key, info in found.items()}


def uploaded_bytes(before: Listing, after: Listing) -> int:
    """Bytes of the objects that are new in ``after`` or changed since ``before``."""
    return sum(item[0] for key, item in after.items() if before.get(key) != item)


def measure_mirror(base: str, bucket: str, rank: int, state: Any, step: Any) -> dict[str, Any]:
    """All ranks, once after the timed rounds: for each mode of ``MODES``, ``GENERATIONS``
    saves (a train step ``step()`` before each) to a fresh local root with a mirror below
    ``bucket``; after each, rank 0 waits for the mirror upload (bounded) and counts the bytes
    it put there. Returns (meaningful on rank 0) per mode: ``uploaded`` bytes per generation,
    ``completed`` (the generation's mirror upload completed) and ``failure`` (the reason of
    the last failed upload, if any)."""
    from dist_ckpt import CheckpointConfig, CheckpointManager
    from dist_ckpt.format.manifest import generation_name
    from dist_ckpt.replay.record import read_mirror_state

    out: dict[str, Any] = {}
    for mode, incremental in MODES.items():
        root, url = os.path.join(base, f"mirror-{mode}"), f"{bucket}/{mode}"
        config = CheckpointConfig(root=root, mirror=url, incremental=incremental, keep_last=2,
                                  mirror_keep_last=2)
        result: dict[str, Any] = {"uploaded": [], "completed": [], "failure": None}
        with CheckpointManager(config, state) as mgr:
            for update in range(1, GENERATIONS + 1):
                step()
                before = listing(url) if rank == 0 else {}
                jobs.barrier()
                mgr.save(update)
                mgr.wait()
                if rank == 0:
                    # what the tests do to wait for the mirror (tests/test_mirror.py); bounded
                    drained = mgr.replayer is not None and mgr.replayer.drain(DRAIN_TIMEOUT_S)
                    state_now = read_mirror_state(root)
                    done = drained and state_now.get("last_completed") == generation_name(update)
                    result["uploaded"].append(uploaded_bytes(before, listing(url)))
                    result["completed"].append(bool(done))
                    if not done:
                        failure = state_now.get("last_failure") or {}
                        result["failure"] = failure.get("reason") or ("mirror upload not drained" if not
                                                                      drained else "not completed")
                jobs.barrier()
        jobs.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        out[mode] = result
    return out
