"""Commit tiers: where a generation lives and how it becomes committed there.

Owns: the attempt -> publish -> latest protocol of each tier (``rename``: a POSIX directory;
``objectstore``: a store without rename) and the tier registry (``open_tier``). May import:
``errors``, ``logs``, ``faults``, ``format``, ``storage``. Nothing outside this package asks
which kind a tier is: what differs is a method of :class:`CommitTier` or :class:`Attempt`.
Adding a tier is one module implementing the protocol plus ``register_tier``.
"""

from . import objectstore as _objectstore  # noqa: F401 - registers the object-store tier
from . import rename as _rename  # noqa: F401 - registers the rename tier
from .base import Attempt, CommitTier, GenerationReader, TierOptions, open_tier, register_tier

__all__ = ["Attempt", "CommitTier", "GenerationReader", "TierOptions", "open_tier", "register_tier"]
