"""The save path: staging buffers, the DCP save plan, the per-rank write and the cross-rank
commit protocol, cadence and free-space checks. The replay of committed generations into
another tier is ``dist_ckpt.replay``'s.

Owns: everything between ``save()`` returning and a generation being committed in a tier.
May import: ``restart``, ``format``, ``storage``, ``protocol``, ``tiers``.
"""
