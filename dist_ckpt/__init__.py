"""dist_ckpt: atomic, validated, asynchronous checkpoints for torchrun FSDP/DDP jobs.

The code is grouped by layer (docs/architecture.md); this module re-exports the public
names. ``dist_ckpt.diff`` and ``dist_ckpt.export``, documented before the layout, still
name the modules that now live in ``dist_ckpt.ops``.
"""

import sys as _sys

from . import faults
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
    RankMismatch,
    SignatureError,
    StagingError,
    StorageError,
    TorchVersionMismatch,
    UnsafeNameError,
    UntrustedGenerations,
    ValidationError,
)
from .format.inventory import GenerationInfo
from .manager import CheckpointManager
from .ops.done import DoneRecord
from .restart.sampler import ResumableSampler
from .restart.state import TrainState
from .restore.loader import RestoreResult
from .version import __version__

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
    "NotAtOptimizerBoundary",
    "RankMismatch",
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

from .ops import diff as _diff  # noqa: E402 - after the public names: it imports them
from .ops import export as _export  # noqa: E402

_sys.modules.setdefault(f"{__name__}.diff", _diff)
_sys.modules.setdefault(f"{__name__}.export", _export)
diff = _diff
export = _export
