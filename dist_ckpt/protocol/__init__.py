"""The cross-rank protocol: the checkpoint process group and c10d store (``Comm``), the
messages ranks exchange, and the store keys they use.

Owns: every message between ranks and every store key name. May import: ``errors``,
``logs``, ``format``.
"""
