"""The real-model job of tests/test_real_models.py: a tiny ``transformers`` Llama (built from a
``LlamaConfig``, nothing downloaded), plain or with a PEFT LoRA adapter, under FSDP2 on gloo
ranks, trained through the plain API (``TrainState``, ``CheckpointManager``,
``ResumableSampler``, ``maybe_save``, ``finish``).

Two ways to run it, the same arithmetic:

- in ranks started by ``dist_ckpt.testing.run_ranks``: :func:`train_ranks` (the root given);
- as a script under the launcher (the root from ``DIST_CKPT_ROOT``)::

      python -m launch --checkpoint-root ROOT --nproc-per-node 2 --standalone \\
          tests/helpers/llama_job.py --kind lora --updates 8 --save-every 3

The contract follows the release-export convention (dist_ckpt/export): ``hf_config`` is the
model's ``config.to_dict()`` and, for the LoRA job, ``peft_config`` the ``LoraConfig``'s.
Every rank builds the model from one seed (``fully_shard`` shards each rank's full copy, so
the copies must agree); the LoRA dropout then draws from a per-rank stream, which the
checkpoint's RNG state carries across a restart.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from dist_ckpt import CheckpointConfig, CheckpointManager, ResumableSampler, TrainState

KINDS = ("plain", "lora")
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 32, 64, 2, 4, 2
SEQ, NUM_SAMPLES, BATCH = 16, 64, 2
LORA_RANK, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS = 4, 8, 0.1, ("q_proj", "v_proj")
SEED = 0
DATA_SEED, SAMPLER_SEED = 11, 5
LR = 1e-2


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=SEQ, tie_word_embeddings=True)


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                      target_modules=list(LORA_TARGETS))


def base_model(seed: int = SEED) -> torch.nn.Module:
    """The Llama as built from its config with ``seed``: the frozen base of the LoRA job."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def unsharded(kind: str, seed: int = SEED) -> torch.nn.Module:
    """The job's model before FSDP: what a reader of an export builds to compare with."""
    model = base_model(seed)
    if kind == "lora":
        from peft import get_peft_model

        model = get_peft_model(model, lora_config())
    return model


def contract(kind: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"hf_config": llama_config().to_dict(), "data": "synthetic-tokens-v1"}
    if kind == "lora":
        fields["peft_config"] = lora_config().to_dict()
    return fields


@dataclass
class Job:
    kind: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: ResumableSampler
    state: TrainState
    tokens: torch.Tensor


def build(kind: str, rank: int, world: int, seed: int = SEED) -> Job:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = unsharded(kind, seed)
    for layer in [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]:
        fully_shard(layer)
    fully_shard(model)
    torch.manual_seed(seed + 1000 + rank)  # this rank's dropout stream
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    sampler = ResumableSampler(NUM_SAMPLES, BATCH, rank=rank, world_size=world, seed=SAMPLER_SEED)
    tokens = torch.randint(VOCAB, (NUM_SAMPLES, SEQ), generator=torch.Generator().manual_seed(DATA_SEED))
    state = TrainState(model, optimizer, sampler=sampler, contract=contract(kind))
    return Job(kind, model, optimizer, sampler, state, tokens)


def step(job: Job) -> None:
    batch = job.tokens[job.sampler.next_batch()]
    job.model(input_ids=batch, labels=batch).loss.backward()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)


def consumed(sampler: ResumableSampler) -> int:
    return sampler.epoch * sampler.num_samples + sampler.cursor


def gathered(job: Job) -> dict[str, torch.Tensor]:
    """The full model and optimizer tensors, flattened (``model/<fqn>``,
    ``optim/<param>/<key>``), on rank 0; empty elsewhere (all ranks call this)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(job.model, job.optimizer, options=options)
    if dist.get_rank() != 0:
        return {}
    flat = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for param, per_param in optim_sd["state"].items():
        flat.update({f"optim/{param}/{k}": v.clone() for k, v in per_param.items() if torch.is_tensor(v)})
    return flat


def train(job: Job, config: CheckpointConfig, updates: int, *, crash_at: int | None = None,
          crash_marker: str | None = None) -> tuple[str | None, str]:
    """Restore, train to ``updates`` (``maybe_save`` after each update), ``finish``; return
    (the generation resumed from, the final one). With ``crash_at``, rank 0 SIGKILLs itself
    after that update (:func:`crash_once`)."""
    with CheckpointManager(config, job.state) as mgr:
        resumed = mgr.restore()
        for update in range(resumed.next_update, updates):
            step(job)
            done = update + 1
            if done == crash_at:
                crash_once(crash_marker)
            if done < updates:
                mgr.maybe_save(done, tokens_seen=consumed(job.sampler))
        final = mgr.finish(updates, tokens_seen=consumed(job.sampler))
    return resumed.generation, final.generation


def crash_once(marker: str | None) -> None:
    """Rank 0 SIGKILLs itself, unless ``marker`` exists (it creates it first: one crash a run).
    Rank 0: with forked workers torchrun reports the lowest failed rank only, and rank 1
    fails too, when its next collective loses its peer."""
    if marker is None or dist.get_rank() != 0 or os.path.exists(marker):
        return
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


# ---- in ranks started by dist_ckpt.testing.run_ranks ----------------------------------------
def train_ranks(rank: int, world: int, roots: dict[str, str], updates: int, save_every: int) -> dict:
    """Each kind of ``roots`` (kind -> root) trained uninterrupted, one after the other in
    these ranks (the imports paid once); rank 0 returns each kind's gathered final state."""
    out = {}
    for kind, root in roots.items():
        job = build(kind, rank, world)
        train(job, CheckpointConfig(root=root, save_every=save_every), updates)
        out[kind] = gathered(job)
    return out


def trained_once(updates: int, save_every: int) -> tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]:
    """Both kinds trained uninterrupted on 2 ranks once per suite run, shared as
    ``launchlib.uninterrupted`` shares its runs (the first caller trains under a lock in the
    suite's ``REFERENCES_ENV`` directory, the others wait and read): kind -> its root (to
    be read only: tests of both sessions read it side by side), and kind -> rank 0's gathered
    final state."""
    from dist_ckpt.testing import run_ranks
    from tests.helpers.launchlib import REFERENCES_ENV

    directory = os.environ.get(REFERENCES_ENV) or tempfile.mkdtemp(prefix="dist_ckpt-references-")
    os.environ.setdefault(REFERENCES_ENV, directory)
    key = "llama-" + hashlib.sha256(json.dumps([updates, save_every]).encode()).hexdigest()[:16]
    here = os.path.join(directory, key)
    final = os.path.join(here, "final.pt")  # written last: its presence says the rest is complete
    roots = {kind: os.path.join(here, kind) for kind in KINDS}
    with open(f"{here}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(final):
            shutil.rmtree(here, ignore_errors=True)  # a failed attempt's leftovers
            os.makedirs(here)
            gathered_final = run_ranks(2, train_ranks, roots, updates, save_every)[0]
            torch.save(gathered_final, f"{final}.tmp")
            os.replace(f"{final}.tmp", final)
    return roots, torch.load(final, weights_only=True)


def restore_ranks(rank: int, world: int, roots: dict[str, str]) -> dict:
    """Each kind restored from its root's newest generation into a model built from another
    seed (every byte must come from the checkpoint); rank 0 returns (generation, gathered)."""
    out = {}
    for kind, root in roots.items():
        job = build(kind, rank, world, seed=SEED + 99)
        with CheckpointManager(CheckpointConfig(root=root), job.state) as mgr:
            generation = mgr.restore().generation
        out[kind] = (generation, gathered(job))
    return out


# ---- as a script under the launcher -------------------------------------------------------------
def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, default="lora")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--crash-at", type=int, default=None, help="rank 0 SIGKILLs itself after this update")
    parser.add_argument("--crash-marker", default=None,
                        help="created before the crash; no crash when it exists")
    parser.add_argument("--dump-final", default=None, help="rank 0 saves the gathered final tensors here")
    return parser.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)  # as the in-process ranks: the same arithmetic
    dist.init_process_group("gloo")
    job = build(args.kind, dist.get_rank(), dist.get_world_size())
    train(job, CheckpointConfig(save_every=args.save_every), args.updates, crash_at=args.crash_at,
          crash_marker=args.crash_marker)
    final = gathered(job)
    if args.dump_final and dist.get_rank() == 0:
        torch.save(final, args.dump_final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
