"""The restore path: choose the newest generation that validates in any tier, agree on it
across ranks, load it (resharding through DCP), move blocking invalid generations aside,
and rehearse a restart.

May import: ``restart``, ``format``, ``storage``, ``protocol``, ``tiers``.
"""
