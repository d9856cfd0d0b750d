"""The experiment contract: digests that say what the numbers of a run mean.

The user passes named fields (config, tokenizer, dataset split, ...). A value that is not
already a digest string is reduced to the sha256 of its canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ..errors import ContractMismatch


def field_digest(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def normalize(contract: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(name): field_digest(value) for name, value in sorted((contract or {}).items())}


def digest(contract: Mapping[str, str]) -> str:
    canonical = json.dumps(dict(sorted(contract.items())), separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def differences(saved: Mapping[str, str], current: Mapping[str, str]) -> dict[str, tuple]:
    names = set(saved) | set(current)
    return {n: (saved.get(n), current.get(n)) for n in sorted(names) if saved.get(n) != current.get(n)}


def check(saved: Mapping[str, str], current: Mapping[str, str], *, allow_change: bool) -> dict:
    """Raise :class:`ContractMismatch` when the contracts differ, unless ``allow_change``."""
    diff = differences(saved, current)
    if diff and not allow_change:
        raise ContractMismatch(diff)
    return diff
