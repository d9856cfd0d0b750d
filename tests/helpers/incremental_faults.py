"""Incremental roots for the pruning and power-loss rows (tests/faults/test_incremental_*.py,
tests/test_incremental_prune.py): a fine-tuning job (``tests.helpers.finetune_jobs``: frozen
``base1``/``base2``, each weight a shared object) run in this process at world size 1.

``build(root, saves)`` saves one generation per entry of ``saves`` (its update number; a
negative one changes ``base1`` in place first, so that save writes a new object for it and
reuses ``base2``'s); it returns each generation's model tensors. ``object_refs`` reads which
objects each manifest lists; ``check_committed`` validates, with digests, every generation the
root lists as committed; ``restored`` restores the newest valid one into a fresh job.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dist_ckpt.format.inventory import inventory
from dist_ckpt.format.manifest import OBJECTS_DIR, generation_name
from dist_ckpt.format.validate import read_manifest, validate
from dist_ckpt.storage.local import LocalStore
from tests.helpers.finetune_jobs import Job, manager

Tensors = dict[str, torch.Tensor]


def model_tensors(job: Job) -> Tensors:
    return {name: t.detach().clone() for name, t in job.inner.state_dict().items()}


def change_base(job: Job) -> None:
    """An in-place change of a frozen weight: the proof sees it, the next save writes it."""
    with torch.no_grad():
        job.inner.base1.weight.add_(1.0)


def build(root: str, saves: list[int], job: Job | None = None, **config: Any) -> dict[str, Tensors]:
    """Save ``abs(u)`` for each ``u`` of ``saves`` in one job (one ledger: later saves reuse
    the unchanged base); ``u < 0`` changes ``base1`` in place before that save. Returns
    generation name -> the model tensors it holds."""
    job = job or Job("plain", 0, 1)
    saved: dict[str, Tensors] = {}
    with manager(job, root, **config) as mgr:
        for update in saves:
            job.step()
            if update < 0:
                change_base(job)
            mgr.save(abs(update))
            mgr.wait()
            saved[generation_name(abs(update))] = model_tensors(job)
    return saved


def objects_on_disk(root: str) -> set[str]:
    """``objects/<name>`` of every file in the root's objects/ (aside files included)."""
    folder = os.path.join(root, OBJECTS_DIR)
    return {f"{OBJECTS_DIR}/{n}" for n in os.listdir(folder)} if os.path.isdir(folder) else set()


def object_refs(root: str, names: list[str] | None = None) -> dict[str, set[str]]:
    """Generation -> the objects its manifest lists (every committed one by default)."""
    store = LocalStore(root)
    names = names if names is not None else committed(root)
    return {name: {f.path for f in read_manifest(store, name).objects} for name in names}


def committed(root: str) -> list[str]:
    return sorted(i.name for i in inventory(LocalStore(root), digests=False) if i.state == "committed")


def check_committed(root: str) -> list[str]:
    """Validate, with digests, every generation listed as committed; returns their names."""
    store = LocalStore(root)
    names = committed(root)
    for name in names:
        validate(store, name, digests=True)
    return names


def restored(root: str) -> tuple[str | None, Tensors]:
    """The newest valid generation restored into a fresh job (another seed): its name and
    model tensors."""
    job = Job("plain", 0, 1, seed=99)
    with manager(job, root) as mgr:
        result = mgr.restore()
    return result.generation, model_tensors(job)


def same(left: Tensors, right: Tensors) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
