"""One rank of a job whose nodes have their own local disks (run under torchrun).

Usage: torchrun ... tests/helpers/nodelocal_job.py ROOT MIRROR REFERENCE PHASE
Phase "save": train 4 updates, save at 2 and 4, close (the mirror drains), and rank 0 writes
the gathered tensors to REFERENCE. Phase "restore": restore, check the gathered tensors
against REFERENCE bitwise, and print one JSON line per rank.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dist_ckpt import CheckpointConfig, CheckpointManager
from tests.helpers import workers


def main() -> None:
    root, mirror, reference, phase = sys.argv[1:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    job = workers.build("fsdp", rank, world, seed=0 if phase == "save" else 5)
    config = CheckpointConfig(root=root, mirror=mirror, commit_timeout_s=60)
    with CheckpointManager(config, job.state) as mgr:
        if phase == "save":
            for update in range(1, 5):
                workers.train_step(job)
                if update % 2 == 0:
                    mgr.save(update)
            full = workers.full_state(job)
            if rank == 0:
                torch.save(full, reference)
            out = {"rank": rank}
        else:
            result = mgr.restore()
            full = workers.full_state(job)
            same = None
            if rank == 0:
                saved = torch.load(reference, weights_only=True)
                same = saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in saved)
            out = {"rank": rank, "generation": result.generation, "same": same,
                   "rejected": [str(p) for p in result.rejected]}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
