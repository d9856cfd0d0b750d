"""Loggers of dist_ckpt: every message says which rank logged it.

All loggers live under ``dist_ckpt`` (``dist_ckpt.manager``: one INFO line per committed
generation on rank 0 and one per restore; ``dist_ckpt.mirror``, ``dist_ckpt.retention``,
``dist_ckpt.quarantine``, ...). Turn them up or down as a group with
``logging.getLogger("dist_ckpt").setLevel(logging.INFO)`` (or WARNING to hear only problems).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any


def current_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankAdapter(logging.LoggerAdapter):
    """Prefixes each message with ``[rank N]``."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[rank {current_rank()}] {msg}", kwargs


def get(name: str) -> RankAdapter:
    return RankAdapter(logging.getLogger(name), {})
