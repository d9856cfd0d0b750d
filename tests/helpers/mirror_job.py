"""A single-rank job with a local root and an S3 mirror (run as a subprocess by the tests).

Usage: python -m tests.helpers.mirror_job ROOT MIRROR UPDATE [UPDATE ...]
Faults come from DIST_CKPT_FAULTS. Prints one JSON line of figures before exiting.
"""

from __future__ import annotations

import json
import sys
import time

from dist_ckpt import CheckpointConfig, CheckpointManager
from tests.helpers.local_jobs import make_state, step


def main() -> None:
    root, mirror, *updates = sys.argv[1:]
    state = make_state()
    config = CheckpointConfig(root=root, mirror=mirror, mirror_queue=2, mirror_concurrency=1,
                              async_save=True)
    blocking = []
    with CheckpointManager(config, state) as mgr:
        for update in map(int, updates):
            step(state)
            started = time.perf_counter()
            mgr.save(update)
            blocking.append(time.perf_counter() - started)
            mgr.wait()
        stats = mgr.uploader.stats
    print(json.dumps({"blocking": blocking, "skipped": stats.skipped, "completed": stats.completed,
                      "failed": sorted(stats.failed), "max_queue": stats.max_queue,
                      "max_uploading": stats.max_uploading}))


if __name__ == "__main__":
    main()
