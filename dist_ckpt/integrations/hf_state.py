"""What ``DistCkptTrainer`` (dist_ckpt.integrations.hf) keeps of the Trainer's own state, the
settings it refuses, and where a resumed epoch starts.

- :func:`trainer_extras` / :func:`restore_trainer_state`: the ``TrainerState`` fields a
  continuation needs (global step, fractional epoch, log history, best metric, FLOs, tokens,
  the stateful callbacks' states), kept as JSON in the generation's ``extras``. The fields a
  run computes from its own arguments (max steps, logging, eval and save steps, batch size)
  are the new run's. Extras must be the same on every rank (the save refuses otherwise), so
  the carried log history (:class:`CarriedLog`) leaves out what each rank measures itself:
  run times, throughputs, memory.
- :func:`refused_settings`: the ``TrainingArguments`` this integration cannot honour, each
  with why; the Trainer raises them as one ``ConfigError``.
- :func:`resume_position`: the epoch to continue in and how many of its batches, at this
  world size, the restored data position has consumed.
"""

from __future__ import annotations

import inspect
from typing import Any

from .data import ResumableLoader

TRAINER_STATE_KEY = "hf_trainer_state"
# TrainerState fields carried across a restart (global_step is the generation's next_update)
CARRIED_FIELDS = ("epoch", "total_flos", "num_input_tokens_seen", "best_metric", "best_global_step")
# metrics the Trainer logs that each rank measures for itself (speed_metrics, the memory tracker)
PER_RANK_SUFFIXES = ("_runtime", "_per_second")
PER_RANK_PART = "_mem_"
# the train_sampling_strategy values a ResumableSampler reproduces (shuffled or in order)
SAMPLING_STRATEGIES = {"random": True, "sequential": False}
# the Trainer's methods DistCkptTrainer overrides or calls, with the parameters it relies on;
# private ones, so their presence is checked instead of trusting a version number
OVERRIDE_POINTS: dict[str, tuple[str, ...]] = {
    "_init_training_state": ("max_steps", "num_update_steps_per_epoch", "num_train_epochs",
                             "resume_from_checkpoint", "trial"),
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_run_epoch": ("epoch", "epochs_trained", "steps_trained_in_current_epoch", "resume_from_checkpoint"),
    "_save_checkpoint": ("model", "trial"),
    "_maybe_log_save_evaluate": (),
    "_load_rng_state": ("checkpoint",),
    "_load_callback_state": (),
    "get_resumed_dataloader": ("dataloader", "num_batches"),
    "set_initial_training_values": ("args", "dataloader"),
    "_get_collator_with_removed_columns": ("data_collator", "description"),
    "_remove_unused_columns": ("dataset", "description"),
    "store_flos": (),
    "get_tp_size": (),
    "get_cp_size": (),
    "get_sp_size": (),
}


def missing_override_points(trainer_class: type) -> list[str]:
    """``name(params)`` for each override point ``trainer_class`` lacks or whose parameters
    changed."""
    missing = []
    for name, params in OVERRIDE_POINTS.items():
        method = getattr(trainer_class, name, None)
        if method is None or not set(params) <= set(inspect.signature(method).parameters):
            missing.append(f"{name}({', '.join(params)})")
    return missing


def callback_states(callbacks: list[Any]) -> dict[str, Any]:
    """``ExportableState`` callbacks (and the ``TrainerControl``) by class name, as
    ``TrainerState.stateful_callbacks`` holds them: one state, or a list for repeated classes."""
    states: dict[str, Any] = {}
    for callback in callbacks:
        name, saved = type(callback).__name__, callback.state()
        if name not in states:
            states[name] = saved
        elif isinstance(states[name], list):
            states[name].append(saved)
        else:
            states[name] = [states[name], saved]
    return states


class CarriedLog:
    """The log history as every rank holds it alike, kept up to date by appending: the
    Trainer only appends to ``TrainerState.log_history``. Call :meth:`sync` before each
    manager call; the list it returns is what the next save writes (the manager encodes
    extras inside ``save()``)."""

    def __init__(self, restored: list[dict[str, Any]] | None = None) -> None:
        self.entries: list[dict[str, Any]] = [self.rank_independent(e) for e in restored or []]
        self._seen = len(self.entries)

    @staticmethod
    def rank_independent(entry: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in entry.items() if not (k.endswith(PER_RANK_SUFFIXES) or PER_RANK_PART in k)}

    def sync(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(history) < self._seen:  # replaced by someone else's code: start over from it
            self.entries, self._seen = [], 0
        self.entries.extend(self.rank_independent(e) for e in history[self._seen:])
        self._seen = len(history)
        return self.entries


def trainer_extras(state: Any, stateful: list[Any], log: CarriedLog) -> dict[str, Any]:
    """The carried fields of a ``TrainerState``."""
    carried = {name: getattr(state, name) for name in CARRIED_FIELDS}
    carried["global_step"] = state.global_step
    carried["log_history"] = log.sync(state.log_history)
    carried["stateful_callbacks"] = callback_states(stateful)
    return carried


def restore_trainer_state(state: Any, saved: dict[str, Any] | None, next_update: int) -> CarriedLog:
    """Put the carried fields back into this run's ``TrainerState``; ``next_update`` (the
    generation's) is the global step. Returns the carried log, continued from the saved one."""
    saved = saved or {}
    for name in CARRIED_FIELDS:
        if name in saved:
            setattr(state, name, saved[name])
    state.log_history = list(saved.get("log_history") or [])
    if saved.get("stateful_callbacks"):
        state.stateful_callbacks = saved["stateful_callbacks"]
    state.global_step = next_update
    return CarriedLog(state.log_history)


def refused_settings(args: Any, *, deepspeed: bool, model_parallel: int) -> list[str]:
    """``field=value: why`` for each setting a resume through dist_ckpt cannot honour."""
    refused = []

    def refuse(field: str, why: str) -> None:
        refused.append(f"{field}={getattr(args, field)!r}: {why}")

    if getattr(args, "enable_jit_checkpoint", False):
        refuse("enable_jit_checkpoint", "a SIGTERM saves on each rank alone, mid-step; under python -m "
               "launch a preemption saves every rank at one agreed update")
    if args.auto_find_batch_size:
        refuse("auto_find_batch_size", "a retried loop would open a second manager on the same root")
    if args.ignore_data_skip:
        refuse("ignore_data_skip", "the data position is restored, never replayed or skipped")
    if args.save_only_model:
        refuse("save_only_model", "a generation is the whole restart state")
    if args.load_best_model_at_end:
        refuse("load_best_model_at_end", "the Trainer's best checkpoint is a checkpoint folder, which "
               "this Trainer does not write; pin the best generation instead (checkpoint_manager.pin)")
    if args.dataloader_drop_last:
        refuse("dataloader_drop_last", "the resumable sampler hands out every sample of an epoch")
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    if strategy not in SAMPLING_STRATEGIES:
        refused.append(f"train_sampling_strategy={strategy!r}: the resumable sampler draws "
                       f"{' or '.join(SAMPLING_STRATEGIES)} batches only")
    if deepspeed:
        refused.append("deepspeed: DeepSpeed's engine owns the optimizer state")
    if model_parallel > 1:
        refused.append(f"tensor, context or sequence parallelism (size {model_parallel}): the sampler "
                       "shards data over every rank")
    return refused


def resume_position(loader: ResumableLoader) -> tuple[int, int]:
    """(epoch, batches of it consumed) for the restored position, in batches of this world
    size: the epoch's batches minus those its remaining samples fill. A run saved at another
    world size may have consumed a fraction of a batch of this one; the count rounds down, so
    the Trainer still ends the epoch at its last batch."""
    sampler, position = loader.sampler, loader.state_dict()
    epoch, cursor = position["epoch"], position["cursor"]
    if cursor >= sampler.num_samples:  # the saved epoch was used up: the next one starts
        return epoch + 1, 0
    per_step = sampler.world_size * sampler.batch_size
    remaining = -(-(sampler.num_samples - cursor) // per_step)
    return epoch, len(loader) - remaining
