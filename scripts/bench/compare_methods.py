"""The save methods the compare phase puts side by side, behind one small interface.

Every method saves the same tensors: the model and AdamW state dicts of the job as
``get_state_dict`` returns them (``{"model": ..., "optim": ...}``, what ``TrainState.tensor_state``
hands the library). The raw DCP methods run their collectives on a gloo group of their own, as the
DCP documentation asks for asynchronous saves that overlap training (the library's manager has
its own group too), and write each save into a fresh directory that is deleted after the save.

The fine-tuning job (``--job finetune``) compares three columns only (issue 28): our async eager
save with incremental generations (the default), the same with ``incremental=False`` (every
generation written in full) and raw DCP ``async_save``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from dist_ckpt import CheckpointConfig, CheckpointManager

from . import jobs

# column labels, in table order
OUR_EAGER, OUR_LAZY, OUR_SYNC = "dist_ckpt async eager", "dist_ckpt async lazy", "dist_ckpt sync"
OUR_FULL = "dist_ckpt async eager, incremental=False"
DCP_SYNC, DCP_ASYNC, DCP_STAGED = "DCP save", "DCP async_save", "DCP async_save + async staging"
ORDER = (OUR_EAGER, OUR_FULL, OUR_LAZY, OUR_SYNC, DCP_SYNC, DCP_ASYNC, DCP_STAGED)
FINETUNE_ORDER = (OUR_EAGER, OUR_FULL, DCP_ASYNC)  # the columns of the fine-tuning job
ASYNC = frozenset({OUR_EAGER, OUR_FULL, OUR_LAZY, DCP_ASYNC, DCP_STAGED})


def lazy_supported() -> bool:
    """True when this library has ``CheckpointConfig(snapshot=...)`` (the lazy snapshot)."""
    return "snapshot" in CheckpointConfig.model_fields


def dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dicts raw DCP saves and loads (the keys the library's ``dcp/`` files hold)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def dcp_wait(response: Any) -> None:
    """Wait for a raw DCP async save: its future, or both futures of an ``AsyncSaveResponse``."""
    if hasattr(response, "upload_completion"):
        response.staging_completion.result()
        response.upload_completion.result()
    else:
        response.result()


class Method:
    """One way to save. ``start`` is the blocking ``save()`` call (returns a handle);
    ``before_step`` is what the caller must wait for before the next ``optimizer.step()``;
    ``finish`` waits until the save is durable; ``cleanup`` (all ranks, untimed) bounds disk use."""

    name = ""

    def start(self) -> Any:
        raise NotImplementedError

    def before_step(self, handle: Any) -> None:
        """Nothing by default: the save no longer reads the live tensors (or hooks the step)."""

    def finish(self, handle: Any) -> None:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Nothing by default."""

    def close(self) -> None:
        """Nothing by default."""

    def written_bytes(self) -> int:
        """Bytes on disk that the last save wrote, every rank's files (all ranks, after
        ``finish``, untimed; call it after every save: our saves count the shared objects
        that appeared since the previous call)."""
        raise NotImplementedError


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(parent, name))
               for parent, _dirs, names in os.walk(path) for name in names)


def file_sizes(path: str) -> dict[str, int]:
    """Name -> size of the files directly in ``path`` (empty when it does not exist)."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return {}
    out = {}
    for name in names:
        try:
            out[name] = os.path.getsize(os.path.join(path, name))
        except FileNotFoundError:  # swept by retention meanwhile
            continue
    return out


class OurSave(Method):
    """``CheckpointManager.save`` (eager or lazy snapshot, or sync); ``keep_last=2`` bounds disk.

    Bytes written by a save: its generation directory plus the shared objects
    (``ROOT/objects/``, incremental generations) that were not there at the previous count;
    an object written once and referenced afterwards counts for the save that wrote it only."""

    def __init__(self, name: str, root: str, state: Any, **options: Any) -> None:
        self.name, self.root = name, root
        config = CheckpointConfig(root=root, keep_last=2, **options)
        self.mgr = CheckpointManager(config, state)
        self.update = 0
        self.objects_seen: set[str] = set()

    def start(self) -> Any:
        self.update += 1
        return self.mgr.save(self.update)

    def finish(self, handle: Any) -> None:
        self.mgr.wait()

    def close(self) -> None:
        self.mgr.close()

    def written_bytes(self) -> int:
        from dist_ckpt.format import manifest

        # a library from before shared objects (a baseline commit) has no OBJECTS_DIR
        objects_dir = getattr(manifest, "OBJECTS_DIR", None)
        generation_name = manifest.generation_name
        objects = file_sizes(os.path.join(self.root, objects_dir)) if objects_dir else {}
        new = sum(size for name, size in objects.items() if name not in self.objects_seen)
        self.objects_seen = set(objects)
        return tree_bytes(os.path.join(self.root, generation_name(self.update))) + new


class DcpSave(Method):
    """Raw DCP: ``dcp.save``, default ``dcp.async_save``, or ``async_save`` with a
    ``DefaultStager(StagingOptions(use_async_staging=True))`` the caller keeps (its staging
    buffers are reused from one save to the next; nothing pinned or shared on a CPU job)."""

    def __init__(self, name: str, base: str, rank: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, group: dist.ProcessGroup) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.name, self.base, self.rank = name, base, rank
        self.model, self.optimizer, self.group = model, optimizer, group
        self.count = 0
        self.paths: list[str] = []
        self.stager = None
        if name == DCP_STAGED:
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=cuda))

    def _path(self) -> str:
        self.count += 1
        slug = self.name.replace(" ", "-").replace("+", "").replace("--", "-")
        path = os.path.join(self.base, f"{slug}-{self.count}")
        self.paths.append(path)
        return path

    def start(self) -> Any:
        import torch.distributed.checkpoint as dcp

        state, path = dcp_state(self.model, self.optimizer), self._path()
        if self.name == DCP_SYNC:
            return dcp.save(state, checkpoint_id=path, process_group=self.group)
        return dcp.async_save(state, checkpoint_id=path, process_group=self.group,
                              async_stager=self.stager)

    def save_kept(self) -> str:
        """One ``start`` + ``finish`` (all ranks) into a directory that ``cleanup`` leaves,
        for the restore measurement; its path (the caller deletes it)."""
        handle = self.start()
        self.finish(handle)
        return self.paths.pop()

    def before_step(self, handle: Any) -> None:
        if hasattr(handle, "staging_completion"):  # the staging copy still reads the live tensors
            handle.staging_completion.result()

    def finish(self, handle: Any) -> None:
        if self.name != DCP_SYNC:
            dcp_wait(handle)

    def written_bytes(self) -> int:
        return tree_bytes(self.paths[-1])

    def cleanup(self) -> None:
        jobs.barrier()
        if self.rank == 0:
            import shutil

            for path in self.paths:
                shutil.rmtree(path, ignore_errors=True)
        self.paths.clear()
        jobs.barrier()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def root_of(base: str, name: str) -> str:
    """The root directory of one of our methods (a path-safe form of its label)."""
    return os.path.join(base, name.replace(" ", "-").replace(",", "").replace("=", "-"))


def build_methods(base: str, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  state: Any, group: dist.ProcessGroup, job: str = "full") -> dict[str, Method]:
    """Every method of the job (lazy only where the library has it; ``FINETUNE_ORDER`` for the
    fine-tuning job), by column label, in table order."""
    if job == "finetune":
        return {
            OUR_EAGER: OurSave(OUR_EAGER, root_of(base, OUR_EAGER), state, async_save=True),
            OUR_FULL: OurSave(OUR_FULL, root_of(base, OUR_FULL), state, async_save=True, incremental=False),
            DCP_ASYNC: DcpSave(DCP_ASYNC, base, rank, model, optimizer, group),
        }
    methods: dict[str, Method] = {
        OUR_EAGER: OurSave(OUR_EAGER, root_of(base, OUR_EAGER), state, async_save=True),
        OUR_SYNC: OurSave(OUR_SYNC, root_of(base, OUR_SYNC), state, async_save=False),
    }
    if lazy_supported():
        methods[OUR_LAZY] = OurSave(OUR_LAZY, root_of(base, OUR_LAZY), state, async_save=True,
                                    snapshot="lazy")
    for name in (DCP_SYNC, DCP_ASYNC, DCP_STAGED):
        methods[name] = DcpSave(name, base, rank, model, optimizer, group)
    return {name: methods[name] for name in ORDER if name in methods}
