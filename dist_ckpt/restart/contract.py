"""The experiment contract: digests that say what the numbers of a run mean.

The user passes named fields (config, tokenizer, dataset split, ...). A string value is taken
as a digest as it is; any other value is reduced to its canonical JSON
(:mod:`dist_ckpt.restart.canonical`) and digested. A value without a canonical form is
refused when the ``TrainState`` is built, on every rank, so that no two ranks ever digest one
value differently. The canonical values themselves are kept too (within ``MAX_VALUES_BYTES``),
written into each manifest, so that a mismatch can name the key that changed and both values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ABSENT, ConfigError, ContractMismatch
from .canonical import Json, bytes_digest, canonical, dumps

MAX_VALUES_BYTES = 64 << 10  # canonical JSON kept per manifest; a field beyond it keeps its digest
MAX_CHANGES = 20  # differences a ContractMismatch carries; the rest are counted


@dataclass(frozen=True)
class Contract:
    """A contract as the job holds it: ``digests`` (what is compared and recorded),
    ``values`` (canonical JSON of the fields that fit the bound, recorded to explain a
    mismatch) and ``legacy``: the digest a field had before canonical JSON, where it differs
    (an enum, a dataclass, a numpy integer), so that a generation saved by an older version
    with the same value still matches."""

    digests: dict[str, str] = field(default_factory=dict)
    values: dict[str, Json] = field(default_factory=dict)
    legacy: dict[str, str] = field(default_factory=dict)


def build(contract: Mapping[str, Any] | None) -> Contract:
    """Digest and keep each field of ``contract``; ``ConfigError`` names the key path of a
    value that has no canonical form."""
    result = Contract()
    kept = 0
    for name, value in sorted((contract or {}).items(), key=lambda item: str(item[0])):
        name = str(name)
        if isinstance(value, str):  # a digest already (documented): kept as it is
            result.digests[name] = kept_value = value
        elif isinstance(value, bytes | bytearray):
            result.digests[name] = kept_value = bytes_digest(value)
        else:
            kept_value = canonical(value, f"contract[{name!r}]")
            result.digests[name] = _digest_text(dumps(kept_value))
            older = _legacy_digest(value)
            if older is not None and older != result.digests[name]:
                result.legacy[name] = older
        size = len(dumps(kept_value))  # ASCII: characters are bytes
        if kept + size <= MAX_VALUES_BYTES:
            result.values[name] = kept_value
            kept += size
    return result


def normalize(contract: Mapping[str, Any] | None) -> dict[str, str]:
    return build(contract).digests


def field_digest(value: Any) -> str:
    """One value's digest as a contract field's. Lenient: a value without a canonical form
    (``TrainState.extras`` may hold a large tensor) keeps the ``str``-based digest it always
    had, instead of failing the save that compares extras across ranks."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        return bytes_digest(value)
    try:
        return _digest_text(dumps(canonical(value)))
    except ConfigError:
        return _digest_text(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str))


def _digest_text(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _legacy_digest(value: Any) -> str | None:
    try:  # what field_digest computed before canonical JSON
        return _digest_text(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str))
    except (TypeError, ValueError, RecursionError):
        return None


def digest(contract: Mapping[str, str]) -> str:
    canonical_text = json.dumps(dict(sorted(contract.items())), separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical_text.encode("utf-8")).hexdigest()


def differences(saved: Mapping[str, str], current: Mapping[str, str],
                legacy: Mapping[str, str] | None = None) -> dict[str, tuple]:
    names = set(saved) | set(current)
    older = legacy or {}
    return {n: (saved.get(n), current.get(n)) for n in sorted(names)
            if saved.get(n) != current.get(n) and (n not in older or saved.get(n) != older[n])}


def check(saved: Mapping[str, str], current: Mapping[str, str] | Contract, *, allow_change: bool,
          saved_values: Mapping[str, Any] | None = None) -> dict:
    """Raise :class:`ContractMismatch` when the contracts differ, unless ``allow_change``.
    ``saved_values``: the generation's canonical values (None in a manifest written before
    they were recorded: the error then names the fields only)."""
    spec = current if isinstance(current, Contract) else Contract(digests=dict(current))
    diff = differences(saved, spec.digests, spec.legacy)
    if diff and not allow_change:
        if saved_values is None:
            raise ContractMismatch(diff)
        changes = value_changes(diff, saved_values, spec.values)
        raise ContractMismatch(diff, changes=changes[:MAX_CHANGES],
                               unlisted=max(0, len(changes) - MAX_CHANGES))
    return diff


def value_changes(diff: Mapping[str, tuple], saved_values: Mapping[str, Any],
                  current_values: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key path, saved, current)`` for each difference below the differing fields; a
    field whose value either side did not keep (over the bound) is shown by its digests."""
    changes: list[tuple[str, Any, Any]] = []
    for name, (saved_digest, current_digest) in diff.items():
        saved = _side(saved_values, name, saved_digest)
        current = _side(current_values, name, current_digest)
        found = list(_walk(name, saved, current)) \
            if name in saved_values and name in current_values else []
        # no difference in the values although the digests differ (a value the manifest could
        # not hold exactly, such as NaN): the digests are the difference
        changes += found or [(name, saved, current)]
    return changes


def _side(values: Mapping[str, Any], name: str, digest_: str | None) -> Any:
    if digest_ is None:
        return ABSENT
    return values[name] if name in values else digest_


def _walk(path: str, saved: Any, current: Any) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            yield from _walk(f"{path}.{key}", saved.get(key, ABSENT), current.get(key, ABSENT))
    elif isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
        for index, (a, b) in enumerate(zip(saved, current, strict=True)):
            yield from _walk(f"{path}[{index}]", a, b)
    elif _text(saved) != _text(current):  # 1 == 1.0 == True in Python, not in JSON
        yield path, saved, current


def _text(value: Any) -> str:
    return "(absent)" if value is ABSENT else json.dumps(value, sort_keys=True)
