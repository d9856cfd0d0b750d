"""A tiny FSDP2 job on Lightning (Trainer or Fabric), for tests/test_integration_lightning.py.

    python -m launch --checkpoint-root ROOT --nproc-per-node 2 --standalone \\
        tests/helpers/lightning_job.py --api trainer --dump DIR [--crash-at 7 --crash-marker M]

Two gloo ranks on CPU, a 2-layer MLP with dropout (so the RNG streams matter) sharded with
``fully_shard``, AdamW, a step LR schedule, 64 synthetic samples in a ``ResumableLoader``
(batch 4 per rank: 8 updates an epoch). ``--api trainer`` fits 2 epochs with
``DistCkptStrategy`` and a ``ModelCheckpoint`` every ``--save-every`` updates; ``--api fabric``
runs ``--fabric-updates`` updates with ``DistCkptFabricStrategy``, saving as often. ``--own``
runs Lightning's own ``ModelParallelStrategy`` without checkpoints (the uninterrupted
reference; ``--api both`` runs the Trainer and then Fabric in one process).

Evidence: ``--crash-at U`` SIGKILLs rank 1 as it starts update U, once (``--crash-marker``);
each rank writes ``DIR/<api>-rank<R>.pt``: the gathered final weights, the counters, the
learning rate and the sample indices this process trained on, by update.
"""

from __future__ import annotations

import argparse
import multiprocessing.connection
import os
import runpy
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn import functional

NUM_SAMPLES = 64
BATCH = 4
FEATURES = 8


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=["trainer", "fabric", "both"], required=True)
    parser.add_argument("--own", action="store_true", help="Lightning's own strategy, no checkpoints")
    parser.add_argument("--root", default=None, help="checkpoint root (default: DIST_CKPT_ROOT)")
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2, help="Trainer epochs")
    parser.add_argument("--fabric-updates", type=int, default=12)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--crash-marker", default=None)
    parser.add_argument("--dump", required=True, help="directory of the per-rank evidence files")
    return parser.parse_args()


class Samples(torch.utils.data.Dataset):
    """Fixed synthetic regression data: (x, y, index)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.x = torch.randn(NUM_SAMPLES, FEATURES, generator=gen)
        noise = 0.1 * torch.randn(NUM_SAMPLES, 1, generator=gen)
        self.y = self.x @ torch.randn(FEATURES, 1, generator=gen) + noise

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))


def shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def maybe_crash(args: argparse.Namespace, update: int) -> None:
    if args.crash_at == update and dist.get_rank() == 1 and not os.path.exists(args.crash_marker):
        with open(args.crash_marker, "w", encoding="utf-8") as handle:
            handle.write(str(update))
        os.kill(os.getpid(), signal.SIGKILL)


def dump(args: argparse.Namespace, api: str, net: nn.Module, **evidence: Any) -> None:
    weights = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    os.makedirs(args.dump, exist_ok=True)
    torch.save({"weights": {k: v.detach().clone() for k, v in weights.items()}, **evidence},
               os.path.join(args.dump, f"{api}-rank{dist.get_rank()}.pt"))


def checkpoint_config(args: argparse.Namespace) -> Any:
    from dist_ckpt import CheckpointConfig

    return CheckpointConfig(root=args.root, commit_timeout_s=60, close_timeout_s=60)


def run_trainer(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dist_ckpt.integrations.data import ResumableLoader
    from dist_ckpt.integrations.lightning import DistCkptStrategy

    class Module(pl.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net: nn.Module | None = None
            self.seen: list[list[Any]] = []

        def configure_model(self) -> None:
            if self.net is None:
                self.net = shard(make_net(), self.device_mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, index = batch
            maybe_crash(args, self.global_step)
            self.seen.append([self.global_step, index.tolist()])
            assert self.net is not None
            return functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def train_dataloader(self) -> Any:
            return ResumableLoader(Samples(), BATCH, seed=0, rank=self.global_rank,
                                   world_size=self.trainer.world_size)

    pl.seed_everything(0, verbose=False)
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    if args.own:
        strategy: Any = ModelParallelStrategy(**sizes)
        callbacks = []
    else:  # ModelCheckpoint is the cadence; its paths are labels (nothing is written there)
        strategy = DistCkptStrategy(checkpoint_config(args), **sizes)
        callbacks = [ModelCheckpoint(dirpath=os.path.join(args.dump, "labels"), save_top_k=-1,
                                     every_n_train_steps=args.save_every)]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, enable_checkpointing=not args.own, callbacks=callbacks)
    module = Module()
    trainer.fit(module)
    assert module.net is not None
    dump(args, "trainer", module.net, global_step=trainer.global_step, epoch=trainer.current_epoch,
         lr=trainer.optimizers[0].param_groups[0]["lr"], seen=module.seen)


def run_fabric(args: argparse.Namespace) -> None:
    import lightning.fabric as lf
    from lightning.fabric.strategies import ModelParallelStrategy

    from dist_ckpt.integrations.data import ResumableLoader, seeded_generator
    from dist_ckpt.integrations.lightning import DistCkptFabricStrategy

    lf.seed_everything(0, verbose=False)
    sizes = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    strategy = ModelParallelStrategy(shard, **sizes) if args.own else \
        DistCkptFabricStrategy(shard, checkpoint_config(args), **sizes)
    fabric = lf.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = fabric.setup(make_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=0.05))
    schedule = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=5, gamma=0.5)
    # the loader's own generator: its iter() draws no number from the global torch stream
    loader = ResumableLoader(Samples(), BATCH, seed=0, rank=fabric.global_rank, world_size=fabric.world_size,
                             generator=seeded_generator(0))
    state: dict[str, Any] = {"model": net, "optimizer": optimizer, "scheduler": schedule, "loader": loader,
                             "step": 0}
    root = None if args.own else strategy.checkpoint_config.root
    if root is not None:
        fabric.load(root, state)
    seen: list[list[Any]] = []
    while state["step"] < args.fabric_updates:
        for x, y, index in loader:
            maybe_crash(args, state["step"])
            seen.append([state["step"], index.tolist()])
            fabric.backward(functional.mse_loss(net(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            state["step"] += 1
            if root is not None and state["step"] % args.save_every == 0:
                fabric.save(root, state)
            if state["step"] >= args.fabric_updates:
                break
    if root is not None:
        strategy.finish(state)
    dump(args, "fabric", net, global_step=state["step"], epoch=loader.epoch,
         lr=optimizer.param_groups[0]["lr"], seen=seen)


def _rank(rank: int, world: int, port: int, argv: list[str], inherited: tuple[dict[str, str], str]) -> None:
    from dist_ckpt.testing import enter_rank, join_store

    enter_rank(inherited)
    join_store()  # as under torchrun, whose agent holds the store its workers rendezvous in
    # what torchrun gives a worker (TORCHELASTIC_RUN_ID: Lightning's sign that it was launched)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      TORCHELASTIC_RUN_ID=f"lightning-job-{port}", OMP_NUM_THREADS="1")
    sys.argv = [__file__, *argv]
    runpy.run_path(__file__, run_name="__main__")


def run_job(*argv: str, world: int = 2, timeout: float = 120) -> list[int | None]:
    """This script on ``world`` ranks forked from the fork server (what torchrun's agent would
    start, without its interpreter); returns each rank's exit code. As torchrun does, the first
    rank to fail ends the others (a killed rank leaves its peers in a collective)."""
    from dist_ckpt.testing import held_store, rank_context, rank_environment

    context = rank_context()
    with held_store(timeout) as port:
        ranks = [context.Process(target=_rank, args=(rank, world, port, list(argv), rank_environment()))
                 for rank in range(world)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout
        running = list(ranks)
        while running and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in running], deadline - time.monotonic())
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode not in (None, 0) for p in ranks):
                break
        for process in running:
            process.kill()
        for process in ranks:
            process.join(10)
    return [process.exitcode for process in ranks]


def main() -> None:
    args = parse()
    if args.api in ("trainer", "both"):
        run_trainer(args)
    if args.api in ("fabric", "both"):
        run_fabric(args)


if __name__ == "__main__":
    main()
