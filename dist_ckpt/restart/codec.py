"""A pickle-free JSON codec for the small, non-tensor parts of the restart state.

Scheduler, scaler, sampler, RNG and user extras are written as JSON so that reading a
checkpoint never executes code (docs/architecture.md, "Invariants"). Tuples, non-string dict keys,
tensors and NumPy arrays are encoded as tagged objects.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

from ..errors import ValidationError

_TAG = "__dist_ckpt__"
MAX_JSON_BYTES = 256 << 20


def encode(value: Any) -> Any:
    """Turn ``value`` into plain JSON types; raises ``TypeError`` for unsupported objects."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return encode(value.item())
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        # reshape: a 0-dim tensor of a multi-byte dtype cannot be viewed as bytes itself
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return {_TAG: "tensor", "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape), "data": base64.b64encode(raw).decode("ascii")}
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {_TAG: "ndarray", "dtype": array.dtype.str, "shape": list(array.shape),
                "data": base64.b64encode(array.tobytes()).decode("ascii")}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": _encode_items(value)}
    if isinstance(value, list):
        return _encode_items(value)
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v) for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k), encode(v)] for k, v in value.items()]}
    raise TypeError(f"cannot encode {type(value).__name__} in a checkpoint (JSON codec)")


def _encode_items(items: list | tuple) -> list:
    # RNG states are long runs of plain ints (Python's Mersenne Twister: 625): kept as they
    # are without a call per item, the same JSON as item by item
    if all(type(item) is int for item in items):
        return list(items)
    return [encode(item) for item in items]


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode(v) for k, v in value.items()}
    if tag == "tuple":
        return tuple(decode(v) for v in value["items"])
    if tag == "dict":
        return {_hashable(decode(k)): decode(v) for k, v in value["items"]}
    if tag == "tensor":
        dtype = getattr(torch, value["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValidationError(f"unknown tensor dtype {value['dtype']!r}")
        raw = bytearray(base64.b64decode(value["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(value["shape"]).clone()
    if tag == "ndarray":
        array = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value["dtype"]))
        return array.reshape(value["shape"]).copy()
    raise ValidationError(f"unknown tagged value {tag!r}")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def dumps(value: Any) -> bytes:
    return json.dumps(encode(value), sort_keys=True, separators=(",", ":")).encode("utf-8")


def loads(raw: bytes, *, what: str = "state file") -> Any:
    if len(raw) > MAX_JSON_BYTES:
        raise ValidationError(f"{what} is {len(raw)} bytes, over the {MAX_JSON_BYTES} byte bound")
    try:
        return decode(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
            RecursionError) as exc:  # deep nesting is corrupt input, not a crash
        raise ValidationError(f"{what} is not valid: {exc}") from exc
