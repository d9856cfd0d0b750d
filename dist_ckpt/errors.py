"""Error hierarchy: every failure the library raises derives from ``DistCkptError``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


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


class UncommittedGeneration(ValidationError):
    """A generation directory without a manifest that counts: it was never committed (a save
    cut short on a store without rename), or its manifest was rejected and is being moved
    aside. Restore skips it; it is no committed progress of the run."""


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


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Any = _Absent()  # the side of a contract change that has no such field or key
_CHANGES_SHOWN_CHARS = 200  # the launcher keeps a reason's first 300 characters


class ContractMismatch(DistCkptError):
    """The experiment contract of the checkpoint differs from the running job's.

    ``fields`` maps each differing field to ``(saved, current)`` digests. ``changes`` lists
    ``(key path, saved, current)`` canonical values below them (``ABSENT`` for a side without
    the key), when the generation recorded its values; ``unlisted`` counts differences beyond
    ``changes``. Both are empty for a generation saved before values were recorded.
    """

    changes: Sequence[tuple[str, Any, Any]] = ()  # class defaults: a subclass may skip __init__
    unlisted: int = 0

    def __init__(self, fields: dict[str, tuple[str | None, str | None]], *,
                 changes: Sequence[tuple[str, Any, Any]] = (), unlisted: int = 0):
        hint = "pass allow_contract_change=True to restore anyway"
        if changes:
            super().__init__(f"experiment contract changed: {_changes_text(changes, unlisted)}; {hint}")
        else:
            super().__init__(f"experiment contract changed in field(s): {', '.join(sorted(fields))}; {hint}")
        self.fields = fields
        self.changes = list(changes)
        self.unlisted = unlisted


def _changes_text(changes: Sequence[tuple[str, Any, Any]], unlisted: int) -> str:
    """``a.b: saved 16, now 8; c: saved "x", now ABSENT (+3 more)``, one line of bounded length."""
    shown: list[str] = []
    for path, saved, current in changes:
        path = path if len(path) <= 80 else "..." + path[-77:]
        text = f"{path}: saved {_value_text(saved)}, now {_value_text(current)}"
        if shown and sum(len(s) + 2 for s in shown) + len(text) > _CHANGES_SHOWN_CHARS:
            break
        shown.append(text)
    rest = len(changes) - len(shown) + unlisted
    return "; ".join(shown) + (f" (+{rest} more)" if rest else "")


def _value_text(value: Any) -> str:
    if value is ABSENT:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


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


def rank_list(ranks: list[int]) -> str:
    """``0-3, 7``: ranks as runs (a refusal of thousands of ranks stays one short line)."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class RestoreRefused(RestoreError):
    """One or more ranks refused the chosen generation before any state was loaded (a changed
    contract, a model that does not fit, another torch version, a reader that could not open),
    and every rank agreed on it before entering any collective of the load: every rank raises
    this same error. ``failures`` maps each refusing rank to ``Kind: reason``; ``permanent``
    says whether a restart cannot cure it (the launcher stops instead of starting again).

    When the lowest refusing rank raised a :class:`ContractMismatch`, :class:`LayoutMismatch`
    or :class:`TorchVersionMismatch`, the error is also an instance of that class
    (:func:`refused_error`), so ``except ContractMismatch`` around ``restore()`` still holds.
    """

    def __init__(self, generation: str, failures: dict[int, str], *, permanent: bool = False):
        self.generation = generation
        self.failures = dict(failures)
        self.permanent = permanent
        by_reason: dict[str, list[int]] = {}
        for rank, why in sorted(self.failures.items()):
            by_reason.setdefault(why, []).append(rank)
        detail = "; ".join(f"rank{'s' if len(r) > 1 else ''} {rank_list(r)}: {why}"
                           for why, r in by_reason.items())
        # not RestoreError.__init__: with a mismatch class in the MRO, super() would reach it
        DistCkptError.__init__(self, f"restore of {generation} refused on rank(s) "
                                     f"{rank_list(list(self.failures))} before anything was loaded: {detail}")


class ContractRefused(RestoreRefused, ContractMismatch):
    fields: dict = {}  # the lowest refusing rank's, set by refused_error


class LayoutRefused(RestoreRefused, LayoutMismatch):
    missing: list = []
    unexpected: list = []
    mismatched: dict = {}


class TorchVersionRefused(RestoreRefused, TorchVersionMismatch):
    pass


_REFUSED = {ContractMismatch: ContractRefused, LayoutMismatch: LayoutRefused,
            TorchVersionMismatch: TorchVersionRefused}
_REFUSED_BY_NAME = {cls.__name__: refused for cls, refused in _REFUSED.items()}
# what a refusing rank's mismatch carries to every rank (small: keys and values, no tensors)
_DETAILS = ("fields", "changes", "unlisted", "missing", "unexpected", "mismatched")


def refusal_details(exc: BaseException) -> dict[str, Any]:
    """The attributes of a mismatch that the agreed error repeats on every rank."""
    return {name: getattr(exc, name) for name in _DETAILS
            if isinstance(exc, tuple(_REFUSED)) and hasattr(exc, name)}


def error_name(exc: BaseException) -> str:
    """The name a report gives ``exc``: an agreed refusal goes by its mismatch's name."""
    for cls in _REFUSED:
        if isinstance(exc, cls):
            return cls.__name__
    return type(exc).__name__


def refused_error(generation: str, failures: dict[int, str], kinds: dict[int, str], *,
                  permanent: bool, details: dict[str, Any] | None = None) -> RestoreRefused:
    """The agreed refusal every rank raises; ``kinds``: rank -> class name of what it raised;
    ``details``: the lowest refusing rank's :func:`refusal_details`."""
    cls = _REFUSED_BY_NAME.get(kinds[min(kinds)], RestoreRefused) if kinds else RestoreRefused
    error = cls(generation, failures, permanent=permanent)
    if cls is not RestoreRefused:
        for name, value in (details or {}).items():
            setattr(error, name, value)
    return error


class NoValidGeneration(DistCkptError):
    """The roots hold committed generations and restore rejected every one: starting over
    would throw away the run's progress, so that is the user's explicit choice
    (``CheckpointConfig.on_all_rejected="fresh"``, ``restore(on_all_rejected="fresh")`` or the
    launcher's ``--fresh``). ``rejected``: one line per rejected generation, with why. Nothing
    was moved aside."""

    def __init__(self, root: str, rejected: list[str]):
        self.root = root
        self.rejected = list(rejected)
        shown = "; ".join(self.rejected[:8]) + (f"; (+{len(self.rejected) - 8} more)"
                                                if len(self.rejected) > 8 else "")
        super().__init__(
            f"every committed generation under {root} was rejected ({len(self.rejected)}): {shown}; "
            "nothing was moved aside and nothing was loaded. Repair them from another copy, or "
            "start over explicitly (restore(on_all_rejected=\"fresh\"), "
            "CheckpointConfig(on_all_rejected=\"fresh\") or the launcher's --fresh)")


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
