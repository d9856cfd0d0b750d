"""The ``dist-ckpt`` command line: one module per group of subcommands.

The top layer: may import anything in ``dist_ckpt``; nothing imports it.
"""

from .main import main

__all__ = ["main"]
