"""The ``dist-ckpt`` command line (``dist_ckpt.cli:main``): one module per group of
subcommands, dispatched by ``app``.

The top layer: may import anything in ``dist_ckpt``; nothing imports it.
"""

from .app import main

__all__ = ["main"]
