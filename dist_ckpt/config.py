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

from .errors import ConfigError
from .format.signing import KEY_ENV
from .ops import runinfo

ROOT_ENV = "DIST_CKPT_ROOT"


class CheckpointConfig(BaseModel):
    """Settings of a :class:`CheckpointManager`.

    ``root`` is a local path or a URL (``file://``, ``s3://``); when omitted it is read
    from the ``DIST_CKPT_ROOT`` environment variable, and ``mirror`` from ``DIST_CKPT_MIRROR``
    (both exported by ``python -m launch``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    root: str = Field(default="", validate_default=True, description="checkpoint root: path or URL")
    async_save: bool = False
    max_in_flight: int = Field(default=1, ge=1, le=8)
    in_flight_policy: Literal["block", "skip"] = "block"
    commit_timeout_s: float = Field(default=300.0, gt=0)
    close_timeout_s: float = Field(default=600.0, gt=0)
    io_threads: int = Field(default=1, ge=1, le=32)
    background_nice: int = Field(default=10, ge=0, le=19)  # CPU priority drop of background saves
    keep_last: int | None = Field(default=None, ge=1)
    keep_every: int | None = Field(default=None, ge=1)  # milestones kept by every tier's pruning
    storage_options: dict[str, Any] = Field(default_factory=dict)
    cache_dir: str | None = None  # local scratch for object-store roots (default: a temp dir)
    # object-store URL that committed local generations replicate to (default: $DIST_CKPT_MIRROR)
    mirror: str | None = Field(default=None, validate_default=True)
    mirror_queue: int = Field(default=2, ge=1, le=64)  # generations waiting; older ones skipped
    mirror_concurrency: int = Field(default=4, ge=1, le=64)  # parallel object uploads per rank
    mirror_timeout_s: float = Field(default=1800.0, gt=0)
    mirror_keep_last: int | None = Field(default=None, ge=1)  # retention of the mirror tier
    # refuse a save when the root's filesystem lacks room for one more generation (+ headroom)
    check_free_space: bool = True
    space_headroom_bytes: int = Field(default=64 << 20, ge=0)
    # HMAC key for manifest signatures (default: $DIST_CKPT_HMAC_KEY); with a key, saves sign
    # and restore trusts only manifests whose signature verifies
    hmac_key: SecretStr | None = Field(default=None, validate_default=True)
    strict_torch_version: bool = False
    allow_contract_change: bool = False
    # when a signing key rejects every generation: "raise" UntrustedGenerations, or start
    # "fresh" listing them as rejected; None = "raise" under the launcher, "fresh" otherwise
    on_key_rejects_all: Literal["raise", "fresh"] | None = None
    # maybe_save(): save every `save_every` updates, or "auto": T* = sqrt(2 C M) from the
    # measured save cost C of this run and mtbf_s (save_every is then the first interval)
    save_every: int | None = Field(default=None, ge=1)
    cadence: Literal["fixed", "auto"] = "fixed"
    mtbf_s: float = Field(default=4 * 3600.0, gt=0)
    # retention deletes nothing until the newest committed generation passed a rehearsal
    require_rehearsal: bool = False

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            fields = ", ".join(".".join(str(p) for p in e["loc"]) or "config" for e in exc.errors())
            error = ConfigError(f"invalid CheckpointConfig field(s) {fields}: {exc}")
            runinfo.report_failure(error)  # a restart cannot cure a bad config
            raise error from exc

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
            value = os.environ.get(KEY_ENV) or None
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
            raise ValueError("save_every is required with cadence='auto' (the first interval)")
        return self

    @property
    def key_rejects_all_raises(self) -> bool:
        if self.on_key_rejects_all is None:
            return runinfo.under_launcher()
        return self.on_key_rejects_all == "raise"

    @model_validator(mode="after")
    def _check_retention(self) -> CheckpointConfig:
        if self.mirror is not None and (not self.is_local or "://" not in self.mirror):
            raise ValueError("mirror needs a local root and an object-store URL (s3://...)")
        if self.async_save and self.keep_last is not None and self.keep_last < 2:
            raise ValueError(
                "keep_last must be >= 2 with async_save: the newest generation may still be in flight"
            )
        return self

    @property
    def is_local(self) -> bool:
        return "://" not in self.root
