"""Error hierarchy: every failure the library raises derives from ``DistCkptError``."""

from __future__ import annotations

from collections.abc import Mapping


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


class UnsafeFileError(ValidationError):
    """A file below a local root is not a regular file (a symbolic link, FIFO, device, socket
    or directory), or is larger than its reader's bound: it was refused without being opened."""


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


class LayoutMismatch(DistCkptError):
    """The job's tensors do not match the generation's: keys the job has that were not saved
    (``missing``), saved keys the job lacks (``unexpected``), and keys whose shape or dtype
    differ (``mismatched``: key -> (saved, current)). Raised before anything is loaded."""

    def __init__(self, generation: str, missing: list[str], unexpected: list[str],
                 mismatched: dict[str, tuple[str, str]]):
        def some(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")

        parts = [f"missing from the generation: {some(missing)}" if missing else "",
                 f"not in the job: {some(unexpected)}" if unexpected else "",
                 "different shape or dtype: " + some([f"{k} saved {s}, job {c}" for k, (s, c)
                                                      in sorted(mismatched.items())])
                 if mismatched else ""]
        super().__init__(f"{generation} does not fit the job's model/optimizer (nothing was loaded); "
                         + "; ".join(p for p in parts if p))
        self.generation = generation
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched


class TorchVersionMismatch(DistCkptError):
    """Restore under a different torch version than the one that saved, in strict mode."""


class NotAtOptimizerBoundary(DistCkptError):
    """A save was requested while gradients are still accumulated (mid gradient accumulation)."""


class GenerationExists(DistCkptError):
    """A committed generation with this update number already exists; generations are immutable."""


class StagingError(DistCkptError):
    """The state could not be copied into staging buffers."""


def per_rank(failures: Mapping[int, object]) -> str:
    """A multi-rank failure's map as one clause: ``rank 0: why; rank 1: why``."""
    return "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))


class CommitError(DistCkptError):
    """A generation failed to commit. ``failures`` maps rank -> reason; ``generation`` names it."""

    def __init__(self, message: str, *, generation: str | None = None,
                 failures: dict[int, str] | None = None):
        self.generation = generation
        self.failures = dict(failures or {})
        detail = per_rank(self.failures)
        super().__init__(f"{message}" + (f" ({detail})" if detail else ""))


class RestoreError(DistCkptError):
    """Loading the chosen generation failed on other ranks. ``failures`` maps rank -> reason."""

    def __init__(self, message: str, *, failures: dict[int, str]):
        self.failures = dict(failures)
        super().__init__(f"{message}: {per_rank(self.failures)}")


class StorageError(DistCkptError):
    """The storage backend failed (missing root, I/O error, disk full)."""


class InsufficientSpace(StorageError):
    """A filesystem lacks room for one more generation. ``shortfalls`` maps the rank that
    checked (the lowest rank writing to that filesystem) -> the reason."""

    def __init__(self, message: str, *, shortfalls: dict[int, str]):
        self.shortfalls = dict(shortfalls)
        super().__init__(f"{message} ({per_rank(self.shortfalls)})")


class RankMismatch(DistCkptError):
    """State that must be the same on every rank differs. ``differences`` maps rank -> the
    keys that differ from rank 0's."""

    def __init__(self, message: str, *, differences: dict[int, list[str]]):
        self.differences = dict(differences)
        detail = "; ".join(f"rank {r}: {', '.join(keys)}" for r, keys in sorted(self.differences.items()))
        super().__init__(f"{message} ({detail})")


PREEMPTED_EXIT = 75  # EX_TEMPFAIL: neither success nor failure; the job is to be started again


class Preempted(SystemExit):
    """The launcher asked the job to stop (a preemption notice) and this rank committed
    ``generation`` (durable on the root) before stopping. A ``SystemExit``, not a
    ``DistCkptError``: an ``except Exception:`` in a training loop must not swallow it; the
    process exits with :data:`PREEMPTED_EXIT`."""

    def __init__(self, generation: str, update: int) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.generation = generation
        self.update = update

    def __str__(self) -> str:
        return f"preempted: saved {self.generation} at update {self.update}"
