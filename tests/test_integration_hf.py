"""``DistCkptTrainer`` (dist_ckpt.integrations.hf): a ``transformers.Trainer`` job under
``python -m launch`` on 2 gloo ranks (tests/helpers/hf_job.py: a tiny Llama, 64 sequences),
one rank in a forked process for the config's cadence and the refusals, and the pure parts
(where a resumed epoch starts, the carried log, the override points) in this process.

- DDP: a worker SIGKILLed mid-run, the job resumed, then preempted (the job creates the
  launcher's stop file): its state at the preempted update equals, bitwise, an uninterrupted
  run's at that update. A relaunch at 1 rank continues to the end of the second epoch, and
  every sample of each epoch was consumed exactly once across both world sizes.
- FSDP2 (accelerate's, switched on for CPU inside the job script: see its docstring): a
  worker SIGKILLed, the job resumed to its end; bitwise equal to an uninterrupted run.

The uninterrupted runs are computed once per suite run (one interpreter forking the ranks of
both, cached like ``launchlib.uninterrupted``), after the launched job of the calling test.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

import pytest
import torch

from dist_ckpt.errors import PREEMPTED_EXIT
from dist_ckpt.format.manifest import GLOBAL_STATE_FILE
from dist_ckpt.integrations.data import ResumableLoader
from dist_ckpt.integrations.hf_state import (
    CarriedLog,
    missing_override_points,
    refused_settings,
    resume_position,
)
from dist_ckpt.testing import run_ranks
from tests.helpers import launchlib
from tests.helpers.launchlib import launch, run_dir

JOB = os.path.join(launchlib.REPO, "tests", "helpers", "hf_job.py")
NUM_SAMPLES, PER_DEVICE = 64, 4
# DDP, 2 ranks, 8 updates per epoch: rank 0 killed after update 3 (saved at 2), preempted at 6
DDP_ARGS = ("--epochs", "2", "--save-steps", "2")
DDP_PREEMPTED = 6
# FSDP2, 2 ranks, one epoch of 8 updates, asynchronous saves: rank 0 killed after update 5
FSDP_ARGS = ("--fsdp", "--async-save", "--epochs", "1", "--save-steps", "2")
FSDP_UPDATES = 8
# the uninterrupted runs: the same arithmetic (epochs, hence the LR schedule), saving rarely
REFERENCES = {"ddp": [*DDP_ARGS[:2], "--save-steps", "1000", "--stop-at", str(DDP_PREEMPTED)],
              "fsdp": [*FSDP_ARGS[:-2], "--save-steps", "1000"]}


def uninterrupted(name: str) -> dict[str, torch.Tensor]:
    """The final gathered tensors of reference ``name``; the first caller of a suite run
    computes them all while the others wait (a lock file in ``launchlib.REFERENCES_ENV``)."""
    directory = os.environ.get(launchlib.REFERENCES_ENV) or tempfile.mkdtemp(prefix="dist_ckpt-references-")
    os.environ.setdefault(launchlib.REFERENCES_ENV, directory)
    key = "hf-" + hashlib.sha256(json.dumps(REFERENCES, sort_keys=True).encode()).hexdigest()[:16]
    with open(os.path.join(directory, f"{key}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(directory, f"{key}-{name}.pt")):
            scratch = tempfile.mkdtemp(prefix=f"{key}-", dir=directory)
            jobs = [[*args, "--root", f"{scratch}/{job}", "--dump", f"{scratch}/{job}.pt",
                     "--output-dir", f"{scratch}/{job}-output"] for job, args in REFERENCES.items()]
            proc = subprocess.run([sys.executable, JOB, "--references", json.dumps(jobs)], cwd=launchlib.REPO,
                                  env=launchlib.env(), capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
            for job in REFERENCES:
                os.replace(os.path.join(scratch, f"{job}.pt"), os.path.join(directory, f"{key}-{job}.pt"))
    return torch.load(os.path.join(directory, f"{key}-{name}.pt"), weights_only=True)


def assert_bitwise(final_path: str, reference: dict[str, torch.Tensor]) -> None:
    final = torch.load(final_path, weights_only=True)
    assert final.keys() == reference.keys() and any(k.startswith("optim/") for k in final)
    diverged = [k for k in reference if not torch.equal(reference[k], final[k])]
    assert not diverged, f"resumed run diverged in {len(diverged)} tensors, e.g. {diverged[:3]}"


def records(directory: str) -> dict[tuple[int, int], dict[int, dict]]:
    """(world, rank) -> update -> its record; an update replayed after a restart must have
    consumed the same samples as the first time."""
    out: dict[tuple[int, int], dict[int, dict]] = {}
    for name in os.listdir(directory):
        world, rank = name.removesuffix(".jsonl").split("-")
        by_step = out.setdefault((int(world.removeprefix("w")), int(rank.removeprefix("rank"))), {})
        with open(os.path.join(directory, name)) as lines:
            for line in lines:
                record = json.loads(line)
                first = by_step.setdefault(record["step"], record)
                assert first == record, f"update {record['step']} consumed other samples when replayed"
    return out


def consumed_by_epoch(recorded: dict[tuple[int, int], dict[int, dict]]) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for by_step in recorded.values():
        for record in by_step.values():
            epochs.setdefault(record["epoch"], Counter()).update(record["indices"])
    return epochs


@pytest.mark.launcher
@pytest.mark.timeout(600)
@pytest.mark.long(reason="three launcher starts of a transformers job (2 ranks killed, resumed and "
                         "preempted; 1 rank to the end) and, when this test comes first, the "
                         "uninterrupted runs of both transformers jobs")
def test_ddp_killed_resumed_preempted_bitwise_then_one_rank_sees_each_sample_once(tmp_path) -> None:
    root, recorded, stop = str(tmp_path / "root"), tmp_path / "records", tmp_path / "STOP"
    recorded.mkdir()
    common = ("--stop-file", str(stop), "--backoff", "0.5")
    output = ("--output-dir", str(tmp_path / "output"))
    first = launch(root, *common, script=JOB, script_args=(
        *DDP_ARGS, *output, "--crash-at", "3", "--crash-rank", "0", "--crash-marker", f"{tmp_path}/crashed",
        "--preempt-at", str(DDP_PREEMPTED - 1), "--stop-file", str(stop), "--record", str(recorded),
        "--dump", str(tmp_path / "preempted.pt")))
    assert first.returncode == PREEMPTED_EXIT, first.output[-3000:]
    killed, preempted = first.starts
    assert killed["classification"] == "transient" and "rank 0 killed by SIGKILL" in killed["reason"]
    assert preempted["classification"] == "preempted", preempted
    assert (preempted["resumed_from"], preempted["resumed_update"]) == ("gen-000000000002", 2)
    assert f"preempted: saved gen-{DDP_PREEMPTED:012d} at update {DDP_PREEMPTED}" in first.output
    assert_bitwise(str(tmp_path / "preempted.pt"), uninterrupted("ddp"))

    stop.unlink()  # the operator's stop file stays until removed
    second = launch(root, *common, nproc=1, script=JOB,
                    script_args=(*DDP_ARGS, *output, "--record", str(recorded)))
    assert second.returncode == 0, second.output[-3000:]
    (relaunched,) = second.starts
    assert (relaunched["resumed_from"], relaunched["classification"]) == (f"gen-{DDP_PREEMPTED:012d}", "done")
    # 2 ranks: 6 updates of 8 samples; 1 rank: the epoch's last 16 in 4 updates, then 16 more
    left_in_epoch = NUM_SAMPLES - DDP_PREEMPTED * 2 * PER_DEVICE
    last = DDP_PREEMPTED + left_in_epoch // PER_DEVICE + NUM_SAMPLES // PER_DEVICE
    done = json.load(open(os.path.join(run_dir(root), "DONE.json")))
    assert done["generation"] == f"gen-{last:012d}" and done["world_size"] == 1
    saved = json.load(open(os.path.join(run_dir(root), done["generation"], GLOBAL_STATE_FILE)))
    assert (saved["data"]["epoch"], saved["data"]["cursor"]) == (1, NUM_SAMPLES)
    trainer_state = saved["extras"]["hf_trainer_state"]
    assert trainer_state["global_step"] == last and trainer_state["epoch"] == 2
    # the linear decay was re-timed to the steps of 1 rank: it reached 0 with the data
    assert saved["scheduler"]["last_epoch"] == last and saved["scheduler"]["_last_lr"] == [0.0, 0.0]
    # the log history crossed both restarts, one entry per 2 updates, and its fractional epochs
    # count batches of 8 samples at 2 ranks, then of 4 from the 48th sample on at 1 rank
    logged = trainer_state["log_history"]
    assert [entry["step"] for entry in logged] == list(range(2, last + 1, 2))
    assert [entry["epoch"] for entry in logged] == [
        step * 2 * PER_DEVICE / NUM_SAMPLES if step <= DDP_PREEMPTED
        else (DDP_PREEMPTED * 2 * PER_DEVICE + (step - DDP_PREEMPTED) * PER_DEVICE) / NUM_SAMPLES
        for step in range(2, last + 1, 2)]

    runs = records(str(recorded))
    assert set(runs) == {(2, 0), (2, 1), (1, 0)}
    assert sorted(runs[2, 0]) == sorted(runs[2, 1]) == list(range(1, DDP_PREEMPTED + 1))
    assert sorted(runs[1, 0]) == list(range(DDP_PREEMPTED + 1, last + 1))
    epochs = consumed_by_epoch(runs)
    assert set(epochs) == {0, 1}
    for epoch, seen in epochs.items():
        assert seen == Counter(range(NUM_SAMPLES)), f"epoch {epoch}: not every sample exactly once"


@pytest.mark.launcher
@pytest.mark.timeout(600)
@pytest.mark.long(reason="two launcher starts of a transformers FSDP2 job and, when this test comes "
                         "first, the suite's uninterrupted runs of both transformers jobs")
def test_fsdp2_killed_worker_resumes_bitwise(tmp_path) -> None:
    root = str(tmp_path / "root")
    result = launch(root, "--backoff", "0.5", script=JOB, script_args=(
        *FSDP_ARGS, "--output-dir", str(tmp_path / "output"), "--crash-at", "5", "--crash-rank", "0",
        "--crash-marker", str(tmp_path / "crashed"),
        "--dump", str(tmp_path / "final.pt")))
    assert result.returncode == 0, result.output[-3000:]
    killed, resumed = result.starts
    assert killed["classification"] == "transient" and "rank 0 killed by SIGKILL" in killed["reason"]
    # asynchronous saves: the kill may come before generation 4 committed
    assert resumed["resumed_from"] in ("gen-000000000002", "gen-000000000004"), resumed
    assert resumed["classification"] == "done"
    done = json.load(open(os.path.join(run_dir(root), "DONE.json")))
    assert done["generation"] == f"gen-{FSDP_UPDATES:012d}"
    assert_bitwise(str(tmp_path / "final.pt"), uninterrupted("fsdp"))


def cadence_and_refusals(rank: int, world: int, root: str, output_dir: str) -> dict:
    """One rank: the refusals, then ``save_every`` as the only cadence (the Trainer's is off),
    ``save_total_limit`` as ``keep_last``, a second ``train()`` with more steps that resumes
    where the first finished, a third that finds nothing left to train, and the export of the
    last generation loaded back with ``from_pretrained``."""
    from transformers import Trainer

    from dist_ckpt import CheckpointConfig, ConfigError
    from dist_ckpt.integrations.hf import DistCkptTrainer
    from tests.helpers.hf_job import Tokens, tiny_llama, training_arguments

    out: dict = {"override_points_missing": missing_override_points(Trainer)}
    config = CheckpointConfig(root=root, save_every=3)
    try:
        refused = training_arguments(output_dir, ignore_data_skip=True, save_only_model=True)
        DistCkptTrainer(model=tiny_llama(), args=refused, train_dataset=Tokens(), checkpoint_config=config)
    except ConfigError as exc:
        out["refused"] = str(exc)

    def trainer(max_steps: int) -> DistCkptTrainer:
        args = training_arguments(output_dir, max_steps=max_steps, save_strategy="no", save_total_limit=2)
        return DistCkptTrainer(model=tiny_llama(), args=args, train_dataset=Tokens(),
                               checkpoint_config=config)

    first = trainer(7)
    try:
        first.train(resume_from_checkpoint="checkpoint-5")
    except ConfigError as exc:
        out["path_refused"] = str(exc)
    first.train()
    assert first.checkpoint_manager is not None and first.checkpoint_done is not None
    out["keep_last"] = first.checkpoint_config.keep_last
    out["first"] = sorted(g.name for g in first.checkpoint_manager.generations())
    out["first_done"] = first.checkpoint_done.generation
    second = trainer(9)
    second.train(resume_from_checkpoint=True)
    assert second.checkpoint_manager is not None and second._train_loader is not None
    out["second"] = sorted(g.name for g in second.checkpoint_manager.generations())
    out["second_steps"] = second.state.global_step
    out["logged_steps"] = [entry["step"] for entry in second.state.log_history if "loss" in entry]
    out["consumed"] = second._train_loader.consumed
    third = trainer(9)  # resumed where max_steps ends: nothing left to train
    third.train()
    assert third.checkpoint_manager is not None
    out["third"] = (third.state.global_step, sorted(g.name for g in third.checkpoint_manager.generations()))
    # the model's config is the contract's hf_config: the export loads with from_pretrained
    from transformers import LlamaForCausalLM

    from dist_ckpt.cli.app import main as cli

    out["export"] = cli(["export", root, "--out", f"{output_dir}/export"])
    exported = LlamaForCausalLM.from_pretrained(f"{output_dir}/export").state_dict()
    out["export_equal"] = all(torch.equal(tensor, exported[name]) for name, tensor in
                              third.model.state_dict().items())
    return out


@pytest.mark.processes
def test_config_cadence_retention_second_train_and_refusals(tmp_path) -> None:
    (out,) = run_ranks(1, cadence_and_refusals, str(tmp_path / "root"), str(tmp_path / "output"))
    assert out["override_points_missing"] == []
    assert "ignore_data_skip=True" in out["refused"] and "save_only_model=True" in out["refused"]
    assert "resume_from_checkpoint='checkpoint-5'" in out["path_refused"]
    # save_every=3 alone (save_strategy="no"), finish at 7; save_total_limit=2 kept the newest two
    assert out["keep_last"] == 2
    assert out["first"] == ["gen-000000000006", "gen-000000000007"]
    assert out["first_done"] == "gen-000000000007"
    # resumed at 7, saved 9 (a multiple of 3), finished there: 6 pruned
    assert out["second"] == ["gen-000000000007", "gen-000000000009"] and out["second_steps"] == 9
    assert out["logged_steps"] == [2, 4, 6, 8], "the log history did not carry over"
    assert out["consumed"] == 9 * PER_DEVICE
    assert out["third"] == (9, out["second"])
    assert out["export"] == 0 and out["export_equal"]


def test_resume_position_at_the_same_and_at_another_world_size() -> None:
    def loader(world: int, rank: int = 0, epoch: int = 0, cursor: int = 0) -> ResumableLoader:
        made = ResumableLoader(list(range(NUM_SAMPLES)), PER_DEVICE, seed=3, rank=rank, world_size=world)
        made.load_state_dict({"num_samples": NUM_SAMPLES, "seed": 3, "shuffle": True, "epoch": epoch,
                              "cursor": cursor})
        return made

    assert resume_position(loader(1)) == (0, 0)
    assert resume_position(loader(2, cursor=48)) == (0, 6)  # 6 of 8 global batches of 8
    assert resume_position(loader(1, cursor=48)) == (0, 12)  # the same samples: 12 of 16 batches of 4
    assert resume_position(loader(2, epoch=1, cursor=NUM_SAMPLES)) == (2, 0)  # the epoch was used up
    # 13 batches of 4 at 1 rank, resumed at 2: the 12 samples left fill 2 batches of 8 (the last
    # one half), so the epoch's 8 batches count 6 consumed, and the 2 ranks get exactly those 12
    assert resume_position(loader(2, cursor=52)) == (0, 6)
    left = [index for rank in range(2) for batch in loader(2, rank=rank, cursor=52) for index in batch]
    seen = [index for batch in loader(1) for index in batch]
    assert sorted(left) == sorted(seen[52:]) and len(left) == 12


def test_carried_log_leaves_out_what_each_rank_measures() -> None:
    restored = [{"loss": 2.0, "step": 1, "train_mem_cpu_alloc_delta": 7}]
    log = CarriedLog(restored)
    assert log.entries == [{"loss": 2.0, "step": 1}]
    history = [*log.entries, {"loss": 1.0, "step": 2},
               {"eval_loss": 0.5, "eval_runtime": 0.12, "eval_samples_per_second": 400.0, "step": 2}]
    expected = [{"loss": 2.0, "step": 1}, {"loss": 1.0, "step": 2}, {"eval_loss": 0.5, "step": 2}]
    assert log.sync(history) == expected
    assert log.sync(history) == expected  # nothing new: nothing appended


def test_refused_settings_and_missing_override_points() -> None:
    from types import SimpleNamespace

    args = SimpleNamespace(enable_jit_checkpoint=True, auto_find_batch_size=False, ignore_data_skip=False,
                           save_only_model=False, load_best_model_at_end=True, dataloader_drop_last=True,
                           train_sampling_strategy="group_by_length")
    refused = refused_settings(args, deepspeed=True, model_parallel=2)
    assert [line.split(":")[0].split("=")[0] for line in refused] == [
        "enable_jit_checkpoint", "load_best_model_at_end", "dataloader_drop_last", "train_sampling_strategy",
        "deepspeed", "tensor, context or sequence parallelism (size 2)"]

    class Older:
        def _run_epoch(self, model, epoch, train_dataloader) -> None: ...

    missing = missing_override_points(Older)
    assert any(m.startswith("_run_epoch(") for m in missing) and any(m.startswith("get_resumed_dataloader(")
                                                                      for m in missing)
