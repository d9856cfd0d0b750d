"""Canonical JSON of an experiment-contract value: the same text on every rank and in every
process for the same value.

``json.dumps(value, default=str)`` is not canonical: ``str`` of a set follows
``PYTHONHASHSEED`` (a PEFT ``LoraConfig.to_dict()`` holds one), and ``str`` of most objects
carries an address, so two ranks of one job would digest one config differently. A value is
therefore first reduced to plain JSON types (sets sorted, dataclasses and pydantic models as
their fields, enums by value, paths as strings, small arrays as lists), and a value with no
such form is refused with its key path instead of being digested by ``str``.

Plain JSON values give the text ``json.dumps(value, sort_keys=True)`` gave before, so the
digests of existing contracts do not change (dict keys keep ``json``'s order and spelling).
"""

from __future__ import annotations

import datetime
import decimal
import enum
import functools
import hashlib
import json
import pathlib
import sys
import types
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import Any, TypeAlias

from pydantic import BaseModel

from ..errors import ConfigError

Json: TypeAlias = "None | bool | int | float | str | list[Json] | dict[str, Json]"

MAX_ARRAY_ITEMS = 4096  # a larger array or tensor is data, not configuration: pass its digest
MAX_DEPTH = 64  # deeper nesting is a cycle (a list holding itself) or not a config at all
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.BuiltinMethodType, functools.partial)
_AS_STRING = (pathlib.PurePath, uuid.UUID, decimal.Decimal)  # their str is their value


def canonical(value: Any, path: str = "contract") -> Json:
    """``value`` as plain JSON types; raises ``ConfigError`` naming ``path`` (and the key
    path below it) for a value that has no canonical form."""
    return _canonical(value, path, 0)


def dumps(value: Json) -> str:
    """The digested text of a canonical value: compact, ASCII, keys in the order
    :func:`canonical` gave them (which is ``json``'s ``sort_keys`` order)."""
    return json.dumps(value, separators=(",", ":"))


def bytes_digest(value: bytes | bytearray) -> str:
    return "sha256:" + hashlib.sha256(bytes(value)).hexdigest()


def _canonical(value: Any, path: str, depth: int) -> Json:
    if depth > MAX_DEPTH:
        raise _refused(path, f"a value nested deeper than {MAX_DEPTH} levels (a cycle?)")
    if isinstance(value, enum.Enum):  # before str and int: a str or int enum is one too
        return _canonical(value.value, path, depth + 1)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # the characters, not a subclass's own __str__
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, bytes | bytearray):
        return bytes_digest(value)
    if isinstance(value, _AS_STRING):
        return str(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return _container(value, path, depth)


def _container(value: Any, path: str, depth: int) -> Json:
    if isinstance(value, Mapping):
        return _mapping(value, path, depth)
    if isinstance(value, set | frozenset):
        # sorted by their canonical text: elements of mixed types have no order of their own
        items = [_canonical(item, f"{path}[<set element>]", depth + 1) for item in value]
        return sorted(items, key=dumps)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray):
        return [_canonical(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)]
    if is_dataclass(value) and not isinstance(value, type):
        return _mapping({f.name: getattr(value, f.name) for f in fields(value)}, path, depth)
    if isinstance(value, BaseModel):
        # python mode, not mode="json": pydantic writes a set in its iteration order
        return _canonical(value.model_dump(), path, depth + 1)
    return _array(value, path, depth)


def _array(value: Any, path: str, depth: int) -> Json:
    # looked up, not imported: an object of numpy or torch exists only if they were imported
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        item = value.item()
        if type(item) is type(value):  # longdouble and friends have no Python equivalent
            raise _refused(path, f"a numpy {type(value).__name__}")
        return _canonical(item, path, depth + 1)
    if np is not None and isinstance(value, np.ndarray):
        if value.size > MAX_ARRAY_ITEMS:
            raise _refused(path, f"a numpy array of {value.size} elements (over {MAX_ARRAY_ITEMS})")
        return _canonical(value.tolist(), path, depth + 1)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        # a subclass (DTensor, a fake or meta tensor) has no local values to list
        if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_meta:
            raise _refused(path, f"a {type(value).__name__}")
        if value.numel() > MAX_ARRAY_ITEMS:
            raise _refused(path, f"a tensor of {value.numel()} elements (over {MAX_ARRAY_ITEMS})")
        return _canonical(value.detach().cpu().tolist(), path, depth + 1)
    raise _refused(path, _what(value))


def _mapping(value: Mapping[Any, Any], path: str, depth: int) -> dict[str, Json]:
    keys = {key: _key(key, path) for key in value}
    texts: dict[str, Any] = {}
    for key, text in keys.items():
        if text in texts:  # {1: .., "1": ..}: one JSON key, two values
            raise ConfigError(f"{path}: keys {texts[text]!r} and {key!r} are the same JSON key "
                              f"{text!r}; a contract value needs distinct keys")
        texts[text] = key
    try:  # json's sort_keys order (numbers numerically), so that digests stay as they were
        ordered = sorted(value, key=_plain_key)
    except TypeError:  # keys of mixed types: ordered by their JSON text
        ordered = sorted(value, key=keys.__getitem__)
    return {keys[key]: _canonical(value[key], f"{path}[{key!r}]", depth + 1) for key in ordered}


def _plain_key(key: Any) -> Any:
    return key.value if isinstance(key, enum.Enum) else key


def _key(key: Any, path: str) -> str:
    plain = _plain_key(key)
    if isinstance(plain, str):
        return str.__str__(plain)
    # json's own spelling of a non-string key: "1", "1.5", "true", "null"
    if plain is None or isinstance(plain, bool):
        return json.dumps(plain)
    if isinstance(plain, int):
        return json.dumps(int(plain))
    if isinstance(plain, float):
        return json.dumps(float(plain))
    raise ConfigError(f"{path}: a key of type {type(key).__name__} ({_short(key)}) is not a contract "
                      "key (str, int, float, bool, None or an enum of these)")


def _what(value: Any) -> str:
    if isinstance(value, _FUNCTIONS):
        return "a function"
    if isinstance(value, type):
        return f"a class ({value.__qualname__})"
    if isinstance(value, types.ModuleType):
        return f"a module ({value.__name__})"
    if callable(value):
        return f"a callable {type(value).__qualname__}"
    return f"an object of type {type(value).__module__}.{type(value).__qualname__}"


def _refused(path: str, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what} is not a contract value (it has no canonical JSON form: "
                       "pass a digest string, or JSON data, sets, enums, paths, dataclasses, "
                       "pydantic models or small arrays)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
