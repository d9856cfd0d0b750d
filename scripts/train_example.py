"""Example training job for ``python -m launch``: resumable, with a DONE record at the end.

    python -m launch --checkpoint-root runs-demo --nproc-per-node 2 --standalone \\
        scripts/train_example.py --updates 24 --save-every 4

The checkpoint root comes from ``DIST_CKPT_ROOT`` (the launcher exports it), so the script
passes no path. What a real job needs and this one shows: FSDP2 (or DDP with ``--ddp``), an
index-addressed ``ResumableSampler`` (exactly-once data across restarts and world sizes), a
registered NumPy generator, every random source seeded, an experiment contract built from the
config, ``maybe_save`` at each optimizer boundary and ``finish`` at the end.

The options under "fault injection and evidence" exist for the tests and the kill demo
(scripts/demo.sh): a self-inflicted SIGKILL on the first start, an abort after DONE, the consumed sample
indices, and a dump of the final gathered tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dist_ckpt import CheckpointConfig, CheckpointManager, ResumableSampler, TrainState
from dist_ckpt.format.manifest import MANIFEST_NAME, generation_name
from dist_ckpt.storage.base import open_store

NUM_SAMPLES = 4096


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=24, help="total optimizer updates")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--cadence", choices=["fixed", "auto"], default="fixed")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per update")
    parser.add_argument("--width", type=int, default=32, help="hidden width (part of the contract)")
    parser.add_argument("--ddp", action="store_true", help="DDP instead of FSDP2")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--memory-tier", action="store_true",
                        help="save to this node's shared memory; persist every --persist-every")
    parser.add_argument("--persist-every", type=int, default=1)
    parser.add_argument("--commit-timeout", type=float, default=120,
                        help="seconds rank 0 waits for every rank's report (a rank that died "
                        "mid-save holds the others this long)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="exit 0 after this update without finish() (a job cut short)")
    evidence = parser.add_argument_group("fault injection and evidence")
    evidence.add_argument("--crash-at", type=int, default=None,
                          help="SIGKILL a rank after this update, once (see --crash-marker)")
    evidence.add_argument("--crash-rank", type=int, default=1, help="-1: whichever rank has "
                          "no --crash-marker (a marker on a node-local disk picks the node)")
    evidence.add_argument("--crash-marker", default=None,
                          help="file created before the crash; no crash when it exists")
    evidence.add_argument("--crash-after-mirrored", action="store_true",
                          help="before crashing, wait until the mirror holds the newest save")
    evidence.add_argument("--abort-after-finish", action="store_true",
                          help="rank 1 aborts (SIGABRT) after DONE, like a teardown race")
    evidence.add_argument("--record-samples", default=None, metavar="DIR",
                          help="append each rank's consumed sample indices to DIR")
    evidence.add_argument("--dump-final", default=None, metavar="PATH",
                          help="rank 0 saves the gathered final model and optimizer tensors")
    evidence.add_argument("--signal-dir", default=None,
                          help="on SIGTERM/SIGINT, each rank writes DIR/signal-rank<r> and exits")
    return parser.parse_args()


def seed_everything(seed: int) -> np.random.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def build(args: argparse.Namespace, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(args.width, 1))
    if args.ddp:
        model = DistributedDataParallel(model)
    else:
        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:  # cpu_offload gathers onto rank 0 only
        return {}
    flat = {f"model/{k}": v for k, v in model_sd.items()}
    for param, per_param in optim_sd["state"].items():
        flat.update({f"optim/{param}/{k}": v for k, v in per_param.items() if torch.is_tensor(v)})
    return flat


def wait_until_mirrored(config: CheckpointConfig, update: int | None, timeout_s: float = 120) -> None:
    """Poll the mirror (bounded) until generation ``update`` is committed there."""
    if config.mirror is None or update is None:
        return
    mirror = open_store(config.mirror, config.storage_options)
    deadline = time.monotonic() + timeout_s
    while not mirror.exists(f"{generation_name(update)}/{MANIFEST_NAME}"):
        if time.monotonic() > deadline:
            raise SystemExit(f"{generation_name(update)} never reached {config.mirror}")
        time.sleep(0.2)


def on_stop_signal(signal_dir: str | None, rank: int):
    def handler(signum: int, _frame: object) -> None:
        if signal_dir:
            with open(os.path.join(signal_dir, f"signal-rank{rank}"), "w") as marker:
                marker.write(str(signum))
        os._exit(128 + signum)
    return handler


def consumed(sampler: ResumableSampler) -> int:
    """Samples every rank together consumed so far, from the sampler's position (restored
    with it): right across a change of world size, where updates x batch x world is not."""
    return sampler.epoch * sampler.num_samples + sampler.cursor


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # the launcher forwards either
        signal.signal(stop_signal, on_stop_signal(args.signal_dir, rank))
    noise = seed_everything(1234 + rank)
    model, optimizer = build(args, rank)
    data = torch.randn(NUM_SAMPLES, 16, generator=torch.Generator().manual_seed(7))
    target = data.sum(dim=1, keepdim=True).sin()
    sampler = ResumableSampler(NUM_SAMPLES, args.batch, seed=3)
    config = {"width": args.width, "batch": args.batch, "lr": 1e-2, "ddp": args.ddp}
    state = TrainState(model, optimizer, sampler=sampler, numpy_generators={"noise": noise},
                       contract={"config": config})
    ckpt = CheckpointConfig(async_save=args.async_save, save_every=args.save_every,
                            cadence=args.cadence, keep_last=3, commit_timeout_s=args.commit_timeout,
                            memory_tier=args.memory_tier, persist_every=args.persist_every)
    with CheckpointManager(ckpt, state) as mgr:
        resumed = mgr.restore()
        if rank == 0:
            print(f"[train] world {world}: {'fresh start' if resumed.fresh else resumed.generation} "
                  f"at update {resumed.next_update}", flush=True)
        for update in range(resumed.next_update, args.updates):
            indices = sampler.next_batch()
            x = data[indices] + torch.from_numpy(noise.normal(0, 0.01, (len(indices), 16))).float()
            loss = (model(x) - target[indices]).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.record_samples:
                with open(os.path.join(args.record_samples, f"w{world}-rank{rank}.jsonl"), "a") as out:
                    out.write(json.dumps({"update": update, "indices": indices}) + "\n")
            next_update = update + 1
            if next_update == args.crash_at and args.crash_rank in (rank, -1) and not (
                    args.crash_marker and os.path.exists(args.crash_marker)):
                if args.crash_marker:
                    open(args.crash_marker, "w").close()
                if args.crash_after_mirrored:
                    wait_until_mirrored(ckpt, mgr.schedule.last_saved)
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0 and next_update % 4 == 0:
                print(f"[train] update {next_update}: loss {loss.item():.5f}", flush=True)
            if next_update < args.updates:
                mgr.maybe_save(next_update, tokens_seen=consumed(sampler))
            if next_update == args.stop_at:
                mgr.wait()
                break
        else:
            done = mgr.finish(args.updates, tokens_seen=consumed(sampler))
            if rank == 0:
                print(f"[train] DONE: {done.generation}", flush=True)
        final = gathered(model, optimizer)
        if args.dump_final and rank == 0:
            torch.save(final, args.dump_final)
    if args.abort_after_finish and rank == 1:
        os.abort()
    dist.destroy_process_group()
    sys.exit(0)


def run() -> None:
    """``main``, with a peer's loss said in one line: when another rank dies (the demo's planned
    kill, a lost node), this rank's next collective fails, and the launcher restarts the job;
    the backend's multi-line traceback would say nothing more than this line does."""
    try:
        main()
    except dist.DistError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"[train] rank {os.environ.get('RANK', '?')} stopped: a peer left the job "
              f"({type(exc).__name__}: {first[:200]})", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    run()
