"""Progress of long CLI work (verify, export, diff): bytes and rate on a terminal only.

The CLI opens a bar around a command with :func:`bar` (enabled only when stderr is a terminal
and the output is not ``--json``); the code doing the work reports with :func:`advance`, which
costs nothing when no bar is open (library use, tests, pipes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_current: Any = None


@contextmanager
def bar(description: str, *, enabled: bool, total: int | None = None) -> Iterator[None]:
    global _current
    if not enabled:
        yield
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
              leave=False, dynamic_ncols=True) as shown:
        previous, _current = _current, shown
        try:
            yield
        finally:
            _current = previous


def advance(nbytes: int) -> None:
    if _current is not None:
        _current.update(nbytes)
