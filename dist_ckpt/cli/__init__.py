"""The ``dist-ckpt`` command line (``dist_ckpt.cli.main:main``): one module per group of
subcommands.

The top layer: may import anything in ``dist_ckpt``; nothing imports it.
"""
