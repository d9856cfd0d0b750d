"""dist_ckpt: atomic, validated, asynchronous checkpoints for torchrun FSDP/DDP jobs."""

from . import faults
from .config import CheckpointConfig
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
from .manager import CheckpointManager
from .ops.done import DoneRecord
from .ops.inventory import GenerationInfo
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
