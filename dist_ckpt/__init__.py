"""dist_ckpt: atomic, validated, asynchronous checkpoints for torchrun FSDP/DDP jobs."""

from . import faults
from .config import CheckpointConfig
from .done import DoneRecord
from .errors import (
    CommitError,
    ConfigError,
    ContractMismatch,
    DistCkptError,
    GenerationExists,
    InsufficientSpace,
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
from .inventory import GenerationInfo
from .manager import CheckpointManager
from .restore import RestoreResult
from .sampler import ResumableSampler
from .state import TrainState
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
