"""Error hierarchy: every failure the library raises derives from ``DistCkptError``."""

from __future__ import annotations


class DistCkptError(Exception):
    """Root of every error raised by dist_ckpt."""


class ConfigError(DistCkptError):
    """Invalid configuration; the message names the field."""


class ValidationError(DistCkptError):
    """A generation failed validation (structure, size or digest).

    ``generation`` names the generation and ``path`` the offending file, when known.
    """

    def __init__(self, message: str, *, generation: str | None = None, path: str | None = None):
        super().__init__(message)
        self.generation = generation
        self.path = path


class SignatureError(ValidationError):
    """A manifest signature is missing, unreadable or wrong under the configured key."""


class UntrustedGenerations(ValidationError):
    """A signing key is configured and rejects every generation under the root: the job
    would otherwise start over from nothing (a wrong key or an unsigned run)."""


class UnsafeNameError(ValidationError):
    """A generation or file name tries to escape its directory (traversal, absolute path)."""


class ContractMismatch(DistCkptError):
    """The experiment contract of the checkpoint differs from the running job's.

    ``fields`` maps each differing field to ``(saved, current)``.
    """

    def __init__(self, fields: dict[str, tuple[str | None, str | None]]):
        names = ", ".join(sorted(fields))
        super().__init__(
            f"experiment contract changed in field(s): {names}; "
            "pass allow_contract_change=True to restore anyway"
        )
        self.fields = fields


class TorchVersionMismatch(DistCkptError):
    """Restore under a different torch version than the one that saved, in strict mode."""


class NotAtOptimizerBoundary(DistCkptError):
    """A save was requested while gradients are still accumulated (mid gradient accumulation)."""


class GenerationExists(DistCkptError):
    """A committed generation with this update number already exists; generations are immutable."""


class StagingError(DistCkptError):
    """The state could not be copied into staging buffers."""


class CommitError(DistCkptError):
    """A generation failed to commit. ``failures`` maps rank -> reason; ``generation`` names it."""

    def __init__(self, message: str, *, generation: str | None = None,
                 failures: dict[int, str] | None = None):
        self.generation = generation
        self.failures = dict(failures or {})
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{message}" + (f" ({detail})" if detail else ""))


class StorageError(DistCkptError):
    """The storage backend failed (missing root, I/O error, disk full)."""


class InsufficientSpace(StorageError):
    """A filesystem lacks room for one more generation. ``shortfalls`` maps the rank that
    checked (the lowest rank writing to that filesystem) -> the reason."""

    def __init__(self, message: str, *, shortfalls: dict[int, str]):
        self.shortfalls = dict(shortfalls)
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.shortfalls.items()))
        super().__init__(f"{message} ({detail})")


class RankMismatch(DistCkptError):
    """State that must be the same on every rank differs. ``differences`` maps rank -> the
    keys that differ from rank 0's."""

    def __init__(self, message: str, *, differences: dict[int, list[str]]):
        self.differences = dict(differences)
        detail = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in sorted(self.differences.items()))
        super().__init__(f"{message} ({detail})")
