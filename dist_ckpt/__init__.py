"""dist_ckpt: atomic, validated, asynchronous checkpoints for torchrun FSDP/DDP jobs.

The code is grouped by layer (docs/architecture.md); this module re-exports the public
names. ``dist_ckpt.diff`` and ``dist_ckpt.export``, documented before the layout, still
name the modules that now live in ``dist_ckpt.ops``.

The public names are imported on first use (PEP 562): importing a light submodule such as
``dist_ckpt.launcher_api`` (the launcher's) must not import the manager and with it torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import faults
from .version import __version__

# public name -> the module that defines it
_DEFINED_IN = {
    "CheckpointConfig": ".config",
    "CheckpointManager": ".manager",
    "DoneRecord": ".lifecycle.done",
    "GenerationInfo": ".format.inventory",
    "ResumableSampler": ".restart.sampler",
    "RestoreResult": ".restore.loader",
    "TrainState": ".restart.state",
    **dict.fromkeys((
        "CommitError", "ConfigError", "ContractMismatch", "DistCkptError", "GenerationExists",
        "InsufficientSpace", "LayoutMismatch", "NoValidGeneration", "NotAtOptimizerBoundary", "Preempted",
        "RankMismatch", "RestoreError", "RestoreRefused",
        "SignatureError", "StagingError", "StorageError", "TorchVersionMismatch", "UnsafeNameError",
        "UntrustedGenerations", "ValidationError"), ".errors"),
}
_SUBMODULES = ("diff", "export")  # dist_ckpt/diff.py and export.py stand for the ops modules

if TYPE_CHECKING:
    from . import diff as diff  # the redundant aliases mark re-exports
    from . import export as export
    from .config import CheckpointConfig
    from .errors import (
        CommitError,
        ConfigError,
        ContractMismatch,
        DistCkptError,
        GenerationExists,
        InsufficientSpace,
        LayoutMismatch,
        NotAtOptimizerBoundary,
        NoValidGeneration,
        Preempted,
        RankMismatch,
        RestoreError,
        RestoreRefused,
        SignatureError,
        StagingError,
        StorageError,
        TorchVersionMismatch,
        UnsafeNameError,
        UntrustedGenerations,
        ValidationError,
    )
    from .format.inventory import GenerationInfo
    from .lifecycle.done import DoneRecord
    from .manager import CheckpointManager
    from .restart.sampler import ResumableSampler
    from .restart.state import TrainState
    from .restore.loader import RestoreResult

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CommitError",
    "ConfigError",
    "ContractMismatch",
    "DistCkptError",
    "DoneRecord",
    "GenerationExists",
    "GenerationInfo",
    "InsufficientSpace",
    "LayoutMismatch",
    "NoValidGeneration",
    "NotAtOptimizerBoundary",
    "Preempted",
    "RankMismatch",
    "RestoreError",
    "RestoreRefused",
    "ResumableSampler",
    "SignatureError",
    "RestoreResult",
    "StagingError",
    "StorageError",
    "TorchVersionMismatch",
    "TrainState",
    "UnsafeNameError",
    "UntrustedGenerations",
    "ValidationError",
    "__version__",
    "faults",
]


def __getattr__(name: str) -> Any:
    if name in _DEFINED_IN:
        value = getattr(importlib.import_module(_DEFINED_IN[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_DEFINED_IN, *_SUBMODULES})
