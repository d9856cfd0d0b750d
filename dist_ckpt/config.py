"""Validated settings. Errors at construction name the offending field."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from . import runinfo
from .errors import ConfigError
from .format.signing import KEY_ENV, key_from_env
from .storage.base import is_remote

ROOT_ENV = "DIST_CKPT_ROOT"
_HIDDEN_VALUES = frozenset({"hmac_key", "storage_options"})  # secrets: never in a message
_MAX_VALUE_CHARS = 80


class FieldRuleError(ValueError):
    """A rule over several fields, raised by a model validator, attributed to the field the
    user most likely has to change (``keep_last`` for ``keep_last=1`` with ``async_save``)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.value = value
        self.reason = reason


def _shown_value(field: str, value: object) -> str:
    if field.split(".")[0] in _HIDDEN_VALUES:
        return "(hidden)"
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else f"{text[:_MAX_VALUE_CHARS - 3]}..."


def _one_problem(error: Any) -> str:
    """``field=value: reason`` for one of pydantic's errors, without its type tag, input
    echo and documentation URL."""
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldRuleError):
        return f"{cause.field}={_shown_value(cause.field, cause.value)}: {cause.reason}"
    field = ".".join(str(part) for part in error["loc"]) or "config"
    reason = str(cause) if isinstance(cause, ValueError) else error["msg"][:1].lower() + error["msg"][1:]
    if error["type"] == "extra_forbidden":
        return f"{field}: not a CheckpointConfig field"
    if error["type"] == "missing":
        return f"{field}: required"
    return f"{field}={_shown_value(field, error.get('input'))}: {reason}"


def config_error_message(exc: ValidationError) -> str:
    """One line naming each problem's field, value and reason."""
    return "invalid CheckpointConfig: " + "; ".join(_one_problem(e) for e in exc.errors())


class CheckpointConfig(BaseModel):
    """Settings of a :class:`CheckpointManager`.

    ``root`` is a local path or a URL (``file://``, ``s3://``); when omitted it is read
    from the ``DIST_CKPT_ROOT`` environment variable, and ``mirror`` from ``DIST_CKPT_MIRROR``
    (both exported by ``python -m launch``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(
        default="", validate_default=True,
        description="Checkpoint root: a local path (made absolute), `file://` or `s3://` URL. Required; when "
                    f"not passed it is read from `{ROOT_ENV}`, which `python -m launch` exports.")
    async_save: bool = Field(
        default=False,
        description="`save()` returns after the staging copy and the commit runs in the background; the "
                    "default `False` saves synchronously (`save()` returns after the commit).")
    max_in_flight: int = Field(
        default=1, ge=1, le=8,
        description="Asynchronous saves in flight at once (1 to 8), each holding its own staging copy of "
                    "the state; the default allows one.")
    in_flight_policy: Literal["block", "skip"] = Field(
        default="block",
        description="What `save()` does at the `max_in_flight` bound: `block` (wait for the oldest save, "
                    "the default) or `skip` (log a warning and return None).")
    snapshot: Literal["eager", "lazy"] = Field(
        default="eager",
        description="With `async_save`: `eager` (default) copies every tensor before `save()` returns; "
                    "`lazy` returns first and copies parameters and optimizer state in the background "
                    "while the next forward and backward run; an optimizer step pre-hook waits for the "
                    "copy, and any other in-place change of them must call `wait_staged()` first "
                    "(docs/api.md, \"Lazy snapshot\"). A synchronous save is the same either way.")
    commit_timeout_s: float = Field(
        default=300.0, gt=0,
        description="Deadline in seconds for every rank's report of a save; a late rank fails the "
                    "generation (default 5 minutes).")
    close_timeout_s: float = Field(
        default=600.0, gt=0,
        description="How long, in seconds, `close()` / `finish()` wait for in-flight saves and the mirror "
                    "(default 10 minutes).")
    io_threads: int = Field(
        default=1, ge=1, le=32,
        description="Writer threads per rank for a save's files (1 to 32); the default writes with one.")
    digest_algorithm: Literal["blake3", "sha256"] = Field(
        default="blake3",
        description="Digest of every file of a new generation, recorded in its manifest: `blake3` "
                    "(default; cryptographic, and less CPU per byte than sha256) or `sha256`. Generations of "
                    "either kind verify whatever this is set to.")
    direct_io: bool | Literal["auto"] = Field(
        default="auto",
        description="Write shard files past the page cache (`O_DIRECT`: large tensors straight from their "
                    "page-aligned staging buffers, everything else through an aligned buffer reused "
                    "across saves), which saves the kernel's copy and writeback work: `auto` (default) "
                    "does so on a root on a local disk filesystem (ext4, xfs, btrfs, f2fs) and writes "
                    "buffered elsewhere (NFS, FUSE, overlay); `True` tries it on any local root, "
                    "falling back to buffered writes where the filesystem refuses it; `False` writes "
                    "through the page cache (a restore soon after then reads from memory).")
    incremental: bool = Field(
        default=True,
        description="Incremental generations: a frozen parameter (`requires_grad=False`, or in no optimizer "
                    "param group) of over 64 KiB on this rank is written once, as a shared object under "
                    "`ROOT/objects/`, and later generations reference it while its bytes provably did not "
                    "change (the same parameter object, data pointer and version counter); anything not "
                    "proven is written in full. `False` writes every tensor in every generation. Saves "
                    "whose target holds one copy per node (node-local roots or memory on several nodes) "
                    "and object-store roots write in full. See docs/incremental.md.")
    reuse_full_every: int = Field(
        default=0, ge=0,
        description="With `incremental`, every Nth save of a run rewrites its frozen tensors too (fresh "
                    "objects); the default 0 never does.")
    object_copies: int = Field(
        default=2, ge=1, le=2,
        description="Copies of each shared object (`incremental`) on a local root without a `mirror`: the "
                    "default 2 writes each new object a second time, to `ROOT/objects-copy/`, so one damaged "
                    "object is repaired at restore instead of failing every generation that references it "
                    "(the frozen base's bytes twice on the root, one more write of each new object); 1 keeps "
                    "one copy. With a mirror, which holds each object too, the root keeps one. See "
                    "docs/incremental.md.")
    background_nice: int = Field(
        default=10, ge=0, le=19,
        description="CPU priority drop (added nice value, 0 to 19) of the background threads "
                    "(asynchronous saves, mirror uploads, memory-tier persistence), so they yield the "
                    "CPU to training; 0 keeps the training priority.")
    keep_last: int | None = Field(
        default=None, ge=1,
        description="Retention: keep the newest K committed generations under the root (at least 2 with "
                    "`async_save`) and delete older ones after each commit; the default `None` deletes "
                    "nothing.")
    keep_every: int | None = Field(
        default=None, ge=1,
        description="Retention milestones: generations whose update number is a multiple of N survive "
                    "`keep_last` and `mirror_keep_last` pruning on every tier; the default `None` keeps "
                    "no milestones.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to fsspec for object-store roots and the mirror (endpoint, credentials, ...); "
                    "by default the usual AWS environment variables apply.")
    upload_verification: Literal["checksum", "readback"] = Field(
        default="checksum",
        description="How each object uploaded to an `s3://` root or mirror is verified: `checksum` "
                    "(default) sends its CRC32C (SHA256 without the `crc32c` package) with the body, "
                    "which the store checks (`BadDigest` refuses a damaged one), then compares size and "
                    "stored checksum with one HEAD; `readback` downloads each object again and compares "
                    "its digest with the manifest (twice the traffic).")
    cache_dir: str | None = Field(
        default=None,
        description="Local scratch directory for object-store roots and verified downloads; the default "
                    "`None` uses a directory under the system temp dir.")
    mirror: str | None = Field(
        default=None, validate_default=True,
        description="Object-store URL (`s3://...`) that committed generations of a local root replicate "
                    f"to. When not passed it is read from `{runinfo.MIRROR_ENV}` (exported by "
                    "`python -m launch`); without either there is no mirror.")
    mirror_queue: int = Field(
        default=2, ge=1, le=64,
        description="Committed generations waiting for upload (1 to 64); beyond it the oldest waiting one "
                    "is skipped (the newest always goes up).")
    mirror_concurrency: int = Field(
        default=4, ge=1, le=64,
        description="Parallel object uploads per rank to the mirror (1 to 64).")
    mirror_timeout_s: float = Field(
        default=1800.0, gt=0,
        description="Deadline in seconds for every rank's report of a mirror upload (default 30 minutes).")
    mirror_keep_last: int | None = Field(
        default=None, ge=1,
        description="Retention of the mirror tier: keep the newest K generations there (plus `keep_every` "
                    "milestones and pins); the default `None` deletes nothing from the mirror.")
    mirror_every: int = Field(
        default=1, ge=1,
        description="Upload every Nth generation that reaches `root` to the mirror (with `memory_tier`: "
                    "every Nth persisted one; `finish()` always uploads the final one). Needs `mirror`.")
    memory_tier: bool = Field(
        default=False,
        description="Commit every save to the memory tier first: each node's shared memory "
                    "(`/dev/shm/dist_ckpt-<run id>-<root digest>/`, owned by `python -m launch`, "
                    "whose run id it needs), "
                    "so a restarted worker resumes without reading storage; `root` receives every "
                    "`persist_every`-th generation (and the final one) in the background "
                    "(docs/memory-tier.md). With `mirror`, the mirror receives what reaches `root` "
                    "(`mirror_every`).")
    persist_every: int = Field(
        default=1, ge=1,
        description="With `memory_tier`: persist every Nth committed in-memory generation to `root` "
                    "(counted from the job's start; `finish()` always persists the final one).")
    persist_interval_s: float | None = Field(
        default=None, gt=0,
        description="With `memory_tier`: also persist a committed in-memory generation once this many "
                    "seconds have passed since the last one chosen for persistence (or since the job's "
                    "start). Given without `persist_every`, persistence follows the interval alone.")
    persist_queue: int = Field(
        default=2, ge=1, le=64,
        description="With `memory_tier`: committed in-memory generations waiting for persistence to "
                    "`root` (1 to 64); beyond it the oldest waiting one is skipped (the newest always "
                    "goes). `mirror_queue` is the mirror's.")
    persist_timeout_s: float = Field(
        default=1800.0, gt=0,
        description="With `memory_tier`: deadline in seconds for every rank's report of a persistence to "
                    "`root`, and for each node copy of a node-local root (default 30 minutes). "
                    "`mirror_timeout_s` is the mirror's.")
    memory_replica: bool = Field(
        default=True,
        description="With `memory_tier` on more than one node: each node also keeps a copy of its ring "
                    "predecessor's files of the newest in-memory generation, so a node that lost its "
                    "memory (replaced, or its launcher died) still restores from memory "
                    "(docs/memory-tier.md). Each node's leader sends its files to the next node in the "
                    "background.")
    peer_backend: Literal["gloo", "nccl"] = Field(
        default="gloo",
        description="With `memory_tier` on more than one node: the torch.distributed backend of the "
                    "process groups that carry files between node leaders (replicas, restore). `\"nccl\"` "
                    "needs CUDA on every rank; `\"gloo\"` runs anywhere.")
    check_free_space: bool = Field(
        default=True,
        description="Refuse a save (`InsufficientSpace`) when the filesystem written to lacks room for one "
                    "more generation plus `space_headroom_bytes`; the first save of a layout is not checked.")
    space_headroom_bytes: int = Field(
        default=64 << 20, ge=0,
        description="Free space in bytes that `check_free_space` keeps beyond one generation.")
    hmac_key: SecretStr | None = Field(
        default=None, validate_default=True,
        description="Manifest signing key (16+ characters, never printed): saves write an HMAC-SHA256 "
                    "signature and restore trusts only generations whose signature verifies. When not "
                    f"passed it is read from `{KEY_ENV}`; without either nothing is signed.")
    strict_torch_version: bool = Field(
        default=False,
        description="Refuse (`TorchVersionMismatch`) a generation saved by another torch version; by "
                    "default that only warns.")
    allow_contract_change: bool = Field(
        default=False,
        description="Restore although the experiment contract changed; by default a change raises "
                    "`ContractMismatch`.")
    on_key_rejects_all: Literal["raise", "fresh"] | None = Field(
        default=None,
        description="When the signing key rejects every generation: `raise` `UntrustedGenerations`, or "
                    "start `fresh` listing them as rejected; the default `None` raises under the launcher "
                    "and otherwise leaves it to `on_all_rejected`.")
    on_all_rejected: Literal["raise", "fresh"] = Field(
        default="raise",
        description="When the roots hold committed generations and restore rejects every one: `raise` "
                    "`NoValidGeneration` naming each and why, moving none aside (default), or start "
                    "`fresh` from update 0 (they are moved aside under `rejected/`). `restore()` takes the "
                    "same choice per call; the launcher's `--fresh` starts a new run instead.")
    save_every: int | None = Field(
        default=None, ge=1,
        description="`maybe_save()` interval in updates (the first interval with `cadence=\"auto\"`); with "
                    "the default `None`, `maybe_save()` raises `ConfigError`.")
    cadence: Literal["fixed", "auto"] = Field(
        default="fixed",
        description="`maybe_save()` schedule: `fixed` saves at multiples of `save_every`; `auto` every "
                    "T* = sqrt(2 C M) from this run's measured save cost C and `mtbf_s` (needs "
                    "`save_every`).")
    mtbf_s: float = Field(
        default=4 * 3600.0, gt=0,
        description="Mean time between failures M in seconds for `cadence=\"auto\"` (default 4 hours).")
    require_rehearsal: bool = Field(
        default=False,
        description="Retention deletes nothing until the newest committed generation passed `rehearse()`; "
                    "off by default.")

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            error = ConfigError(config_error_message(exc))
            runinfo.report_failure(error)  # a restart cannot cure a bad config
            raise error from None  # pydantic's own text repeats the problem with its noise

    @field_validator("root", mode="before")
    @classmethod
    def _root_from_env(cls, value: object) -> str:
        if value is None or value == "":
            value = os.environ.get(ROOT_ENV, "")
        if not isinstance(value, str | os.PathLike):
            raise ValueError("root must be a path or URL string")
        text = os.fspath(value)
        if not text:
            raise ValueError(f"root is required (pass root= or set {ROOT_ENV})")
        if text.startswith("file://"):
            text = text[len("file://"):]
        if "://" not in text:
            text = os.path.abspath(text)
        return text

    @field_validator("mirror", mode="before")
    @classmethod
    def _mirror_from_env(cls, value: object) -> object:
        # the launcher exports the run's mirror prefix next to its root
        if value is None or value == "":
            value = os.environ.get(runinfo.MIRROR_ENV) or None
        return value

    @field_validator("hmac_key", mode="before")
    @classmethod
    def _key_from_env(cls, value: object) -> object:
        if value is None or value == "":
            value = key_from_env()
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        if value is not None and len(str(value if not isinstance(value, SecretStr)
                                         else value.get_secret_value())) < 16:
            raise ValueError("hmac_key must be at least 16 characters")
        return value

    @property
    def signing_key(self) -> bytes | None:
        return None if self.hmac_key is None else self.hmac_key.get_secret_value().encode("utf-8")

    @model_validator(mode="after")
    def _check_cadence(self) -> CheckpointConfig:
        if self.cadence == "auto" and self.save_every is None:
            # no measured save cost before the first save: it needs a first interval
            raise FieldRuleError("save_every", self.save_every,
                                 "required with cadence='auto' (the first interval)")
        return self

    @model_validator(mode="after")
    def _check_peer_backend(self) -> CheckpointConfig:
        import torch  # noqa: PLC0415 - only this check needs it

        if self.peer_backend == "nccl" and not torch.cuda.is_available():
            raise FieldRuleError("peer_backend", self.peer_backend, "needs CUDA on every rank (none here); "
                                 "use \"gloo\"")
        return self

    @property
    def key_rejects_all_raises(self) -> bool:
        if self.on_key_rejects_all is None:
            return runinfo.under_launcher()
        return self.on_key_rejects_all == "raise"

    @model_validator(mode="after")
    def _check_retention(self) -> CheckpointConfig:
        if self.mirror is not None and (is_remote(self.root) or not is_remote(self.mirror)):
            raise FieldRuleError("mirror", self.mirror,
                                 f"needs a local root (root={self.root!r}) and an object-store URL "
                                 "(s3://...)")
        if self.mirror is None and self.mirror_every != 1:
            raise FieldRuleError("mirror_every", self.mirror_every, "needs mirror (an s3:// URL)")
        if self.persist_interval_s is not None and not self.memory_tier:
            raise FieldRuleError("persist_interval_s", self.persist_interval_s, "needs memory_tier=True")
        for name in ("persist_queue", "persist_timeout_s"):  # persistence's own: the mirror has its own
            if getattr(self, name) != type(self).model_fields[name].default and not self.memory_tier:
                raise FieldRuleError(name, getattr(self, name), "needs memory_tier=True")
        if self.async_save and self.keep_last is not None and self.keep_last < 2:
            raise FieldRuleError("keep_last", self.keep_last, "must be at least 2 with "
                                 "async_save=True: the newest generation may still be in flight")
        return self


# docs/configuration.md's default column where the field's default is not the value a user gets
_SHOWN_DEFAULTS = {
    "root": f"`${ROOT_ENV}`",
    "cache_dir": "temp dir",
    "mirror": f"`${runinfo.MIRROR_ENV}`",
    "hmac_key": f"`${KEY_ENV}`",
    "on_key_rejects_all": 'launcher: `"raise"`, else `"fresh"`',
}


def _shown_default(name: str) -> str:
    if name in _SHOWN_DEFAULTS:
        return _SHOWN_DEFAULTS[name]
    value = CheckpointConfig.model_fields[name].get_default(call_default_factory=True)
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if name.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value and value % size == 0:
                return f"`{value // size} {unit}`"
    return f"`{value!r}`"


def config_table_markdown() -> str:
    """The configuration table of docs/configuration.md (field, default, meaning), one row per
    :class:`CheckpointConfig` field in declaration order, from the fields' descriptions.
    Regenerate that page's copy with ``python scripts/config_table.py --write``."""
    unknown = sorted(set(_SHOWN_DEFAULTS) - set(CheckpointConfig.model_fields))
    if unknown:
        raise ValueError(f"shown defaults for fields CheckpointConfig lacks: {unknown}")
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for name, field in CheckpointConfig.model_fields.items():
        if not field.description:
            raise ValueError(f"CheckpointConfig.{name} has no description")
        meaning = " ".join(field.description.split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_shown_default(name)} | {meaning} |")
    return "\n".join(rows) + "\n"
