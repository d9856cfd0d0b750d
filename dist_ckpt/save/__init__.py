"""The save path: staging buffers, the DCP save plan, the per-rank write and the cross-rank
commit protocol, cadence and free-space checks, and the replay of committed generations into
another tier (the mirror; the memory tier's persistence).

Owns: everything between ``save()`` returning and a generation being committed in a tier.
May import: ``restart``, ``format``, ``storage``, ``protocol``, ``tiers``.
"""
