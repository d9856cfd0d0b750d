"""A training script for ``dist-ckpt rehearse --script``: the fine-tuning job of
``finetune_jobs`` (frozen base, trained adapter and head) under torchrun.

It restores from ``DIST_CKPT_ROOT`` (under ``dist-ckpt rehearse`` the restore rehearses the
generation the command names), trains, and saves after each update; in rehearsal mode the
first save records the rehearsal and ends the process with status 0, writing nothing.
Run with the repository on ``PYTHONPATH``. Arguments: ``KIND`` (plain, ddp, fsdp; default
fsdp) and ``UPDATES`` (default 2, updates after the restored one).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from tests.helpers import finetune_jobs


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    updates = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = finetune_jobs.Job(kind, rank, world, seed=7)  # other bytes than saved: the restore counts
    mgr = finetune_jobs.manager(job, os.environ["DIST_CKPT_ROOT"])
    start = mgr.restore().next_update
    for update in range(start + 1, start + 1 + updates):
        job.step()
        mgr.save(update)  # under a rehearsal: records it and exits 0
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
