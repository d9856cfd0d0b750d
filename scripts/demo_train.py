"""Demo training job (run under torchrun): FSDP2 on gloo, dist_ckpt save and resume.

Each phase restores the newest generation that validates, trains to ``--until`` saving every
``--save-every`` updates, and leaves a reference copy of the gathered tensors of its last
save, so that the next phase (any world size) can check what it loaded bitwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from dist_ckpt import CheckpointConfig, CheckpointManager, ResumableSampler, TrainState

NUM_SAMPLES, BATCH, WIDTH = 4096, 8, 64


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:  # cpu_offload gathers onto rank 0 only
        return {}
    flat = {f"model/{k}": v for k, v in model_sd.items()}
    for param, per_param in optim_sd["state"].items():
        flat.update({f"optim/{param}/{k}": v for k, v in per_param.items() if torch.is_tensor(v)})
    return flat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--mirror", default=None, help="object-store URL to replicate generations to")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # dist_ckpt logs one line per commit and per restore on rank 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("dist_ckpt").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(0)
    # every random source seeded: ranks that did not exist at save time derive their streams
    # from rank 0's saved Python state, so an unseeded `random` makes resharded runs differ
    random.seed(rank)
    np.random.seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(WIDTH, 1))
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = ResumableSampler(NUM_SAMPLES, BATCH, seed=1)
    noise = np.random.default_rng(rank)
    state = TrainState(model, optimizer, sampler=sampler, numpy_generators={"noise": noise},
                       contract={"config": {"width": WIDTH, "batch": BATCH}})
    reference_path = os.path.join(args.root, "reference.pt")
    config = CheckpointConfig(root=os.path.join(args.root, "ckpt"), async_save=True, mirror=args.mirror)
    with CheckpointManager(config, state) as mgr:
        result = mgr.restore()
        loaded = gathered(model, optimizer)
        if rank == 0:
            print(f"[world {world}] checkpoints under {config.root}")
            print(f"[world {world}] resumed from {result.generation or 'nothing (fresh start)'} at "
                  f"update {result.next_update}; rejected: {[str(p) for p in result.rejected]}")
            if result.generation is not None:
                reference = torch.load(reference_path, weights_only=True)
                same = reference.keys() == loaded.keys() and all(
                    torch.equal(reference[k], loaded[k]) for k in reference)
                print(f"[world {world}] all {len(reference)} gathered model and optimizer tensors "
                      f"equal, bitwise, the copies phase 1 took right after saving "
                      f"{result.generation}: {same}")
                if not same:
                    raise SystemExit("loaded tensors differ from the saved ones")
        for update in range(result.next_update, args.until):
            index = sampler.next_batch()
            gen = torch.Generator().manual_seed(1000 + update)
            x = torch.randn(NUM_SAMPLES // 64, WIDTH, generator=gen)[torch.tensor(index) % 64]
            x = x + torch.from_numpy(noise.normal(0, 0.01, x.shape)).float()
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (update + 1) % args.save_every == 0:
                # the samples consumed: right across a change of world size
                mgr.save(update + 1, tokens_seen=sampler.epoch * sampler.num_samples + sampler.cursor)
                snapshot = gathered(model, optimizer)
                if rank == 0:
                    torch.save(snapshot, reference_path + ".tmp")
                    os.replace(reference_path + ".tmp", reference_path)
                if rank == 0:
                    print(f"[world {world}] update {update + 1}: loss {loss.item():.5f}, save requested")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
