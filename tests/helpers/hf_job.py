"""A ``DistCkptTrainer`` job for tests/test_integration_hf.py: a tiny Llama (2 layers, hidden
32, vocab 64, attention dropout, built from its config) fine-tuned on 64 synthetic sequences
held in memory, under ``python -m launch`` (DDP, or FSDP2 with ``--fsdp``) or as the
uninterrupted references (``--references JSON``: one interpreter imports everything once, then
forks the 2 ranks of each job in turn, which rendezvous in a store it holds).

Evidence and faults, each at the end of an optimizer update (``on_step_end``):

- ``--record DIR``: each rank appends the sample indices its update consumed, with the loader's
  epoch, to ``DIR/w<world>-rank<r>.jsonl``;
- ``--crash-at K``: rank ``--crash-rank`` SIGKILLs itself once (``--crash-marker``);
- ``--preempt-at X``: rank 0 creates ``--stop-file`` (the launcher's stop file: a preemption)
  and waits until its manager noticed; the ranks then agree on update X + 1, save it and stop
  with ``Preempted`` (exit 75);
- ``--stop-at S``: training stops after update S (the reference of a preempted run);
- ``--dump PATH``: rank 0 saves the gathered model and optimizer tensors at the end, also on
  ``Preempted``.

``--fsdp`` turns on accelerate's FSDP2 on CPU, which accelerate refuses by itself (with
``use_cpu`` its state is MULTI_CPU and the Trainer falls back to DDP). The patch is a test
measure for CPU-only machines, in this script alone, never in the library: after
``AcceleratorState`` set itself up as MULTI_CPU with an FSDP plugin, it switches to FSDP as
it does on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FSDPModule
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from dist_ckpt import CheckpointConfig, Preempted
from dist_ckpt.integrations.hf import DistCkptTrainer

NUM_SAMPLES, SEQ, VOCAB = 64, 8, 64


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="the Trainer's (it writes nothing there)")
    parser.add_argument("--root", default=None, help="checkpoint root (default: DIST_CKPT_ROOT)")
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--batch", type=int, default=4, help="per device")
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--record", default=None)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--crash-rank", type=int, default=1)
    parser.add_argument("--crash-marker", default=None)
    parser.add_argument("--preempt-at", type=int, default=None)
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--dump", default=None)
    return parser.parse_args(argv)


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences; ``taken`` lists the indices fetched since the last update."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQ), generator=torch.Generator().manual_seed(5))
        self.taken: list[int] = []

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.taken.append(int(index))
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def enable_cpu_fsdp() -> None:
    """Test-only (module docstring): accelerate's FSDP on a CPU gloo group."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


class JobEvents(TrainerCallback):
    def __init__(self, args: argparse.Namespace, data: Tokens) -> None:
        self.args, self.data = args, data
        self.trainer: DistCkptTrainer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        if self.args.fsdp and not isinstance(self.trainer.model, FSDPModule):
            raise SystemExit(f"--fsdp, but the Trainer trains a {type(self.trainer.model).__name__}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None and self.trainer._train_loader is not None
        rank, world, step = dist.get_rank(), dist.get_world_size(), state.global_step
        if self.args.record:
            with open(os.path.join(self.args.record, f"w{world}-rank{rank}.jsonl"), "a") as out:
                out.write(json.dumps({"step": step, "epoch": self.trainer._train_loader.epoch,
                                      "indices": self.data.taken}) + "\n")
        self.data.taken = []
        if step == self.args.crash_at and rank == self.args.crash_rank \
                and not os.path.exists(self.args.crash_marker):
            open(self.args.crash_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.args.preempt_at and rank == 0 and not os.path.exists(self.args.stop_file):
            open(self.args.stop_file, "w").close()
            manager = self.trainer.checkpoint_manager
            assert manager is not None
            deadline = time.monotonic() + 120
            while not manager.preemption.noticed:  # the launcher's notice, seen by this rank's watch
                if time.monotonic() > deadline:
                    raise SystemExit("no preemption notice within 120 s of the stop file")
                time.sleep(0.01)
        if step == self.args.stop_at:
            control.should_training_stop = True


def dump(trainer: DistCkptTrainer, path: str | None) -> None:
    """The gathered model and optimizer tensors (a collective; rank 0 writes)."""
    if path is None:
        return
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(trainer.model, optimizer, options=options)
    if dist.get_rank() == 0:
        flat = {f"model/{k}": v for k, v in model_sd.items()}
        for param, per_param in optim_sd["state"].items():
            flat.update({f"optim/{param}/{k}": v for k, v in per_param.items() if torch.is_tensor(v)})
        torch.save(flat, path)


def training_arguments(output_dir: str, **overrides: Any) -> TrainingArguments:
    """The job's ``TrainingArguments`` (CPU, no reporting, no workers, no progress bars)."""
    settings: dict[str, Any] = {
        "output_dir": output_dir, "per_device_train_batch_size": 4,
        "learning_rate": 1e-2, "weight_decay": 0.01, "save_strategy": "steps", "logging_steps": 2,
        "report_to": "none", "use_cpu": True, "dataloader_num_workers": 0, "disable_tqdm": True,
        "seed": 1234, "ddp_find_unused_parameters": False}
    return TrainingArguments(**{**settings, **overrides})


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same initial weights on every rank
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attention_dropout=0.1,
        attn_implementation="eager"))


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    if args.fsdp:
        enable_cpu_fsdp()
        extra = {"fsdp": True, "fsdp_config": {
            "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
            "state_dict_type": "SHARDED_STATE_DICT"}}
    training = training_arguments(args.output_dir, per_device_train_batch_size=args.batch,
                                  num_train_epochs=args.epochs, save_steps=args.save_steps, **extra)
    data = Tokens()
    events = JobEvents(args, data)
    trainer = DistCkptTrainer(model=tiny_llama(), args=training, train_dataset=data, callbacks=[events],
                              checkpoint_config=CheckpointConfig(root=args.root or "",
                                                                 async_save=args.async_save,
                                                                 commit_timeout_s=60))
    events.trainer = trainer
    try:
        trainer.train()
    except Preempted:
        dump(trainer, args.dump)
        raise
    dump(trainer, args.dump)


def fork_ranks(args: argparse.Namespace, world: int = 2) -> None:
    """One uninterrupted job on ``world`` ranks forked from this process, which imported
    everything once; exits non-zero when a rank failed."""
    from dist_ckpt.testing import AGENT_STORE_ENV, held_store

    children, writers = [], []
    for rank in range(world):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank: the port comes through the pipe, once the store listens
            os.close(write_end)
            with os.fdopen(read_end) as pipe:  # one line: a later rank holds this pipe's write end too
                port = pipe.readline().strip()
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                              **{AGENT_STORE_ENV: "True"})
            code = 0
            try:
                main(args)
                dist.destroy_process_group()
            except BaseException as exc:  # noqa: BLE001 - reported as this rank's exit code
                print(f"[hf_job] rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.close(read_end)
        children.append(pid)
        writers.append(write_end)
    with held_store(300) as port:  # forked before: no store thread is copied into a rank
        for write_end in writers:
            os.write(write_end, f"{port}\n".encode())
            os.close(write_end)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    if codes != [0] * world:
        raise SystemExit(f"reference ranks failed: exit codes {codes}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--references"]:  # --references JSON: a list of argument lists
        for job in json.loads(sys.argv[2]):
            fork_ranks(parse(job))
    else:
        main(parse())
        dist.destroy_process_group()
        sys.exit(0)
