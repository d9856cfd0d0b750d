"""A single-rank job with a local root and an S3 mirror (run as a subprocess by the tests).

Usage: python -m tests.helpers.mirror_job ROOT MIRROR UPDATE [UPDATE ...]
Faults come from DIST_CKPT_FAULTS; a block named by MIRROR_JOB_HOLD (a fault point the
uploader reaches) is released after the last save, and the figures say whether every save
returned while it was held. Prints one JSON line of figures before exiting.
"""

from __future__ import annotations

import json
import os
import sys
import time

from dist_ckpt import CheckpointConfig, CheckpointManager, faults
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
        hold = os.environ.get("MIRROR_JOB_HOLD")
        held_throughout = bool(hold) and bool(faults.reached(hold))  # the uploader is still held
        if hold:
            faults.release(hold)
        stats = mgr.replayer.stats
    print(json.dumps({"blocking": blocking, "saves_while_held": held_throughout,
                      "skipped": stats.skipped, "completed": stats.completed,
                      "failed": sorted(stats.failed), "max_queue": stats.max_queue,
                      "max_uploading": stats.max_uploading}))


if __name__ == "__main__":
    main()
