"""The one walk over a nested state (dicts, lists, tuples of tensors and plain values)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every node of ``value`` with its path (``/key/0/...``), depth first in insertion
    order; a container comes before its items. Tensors are leaves."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk(item, f"{path}/{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from walk(item, f"{path}/{index}")
