"""Replays: a source tier's committed generations copied into a destination tier, one channel
each (``channels``): ``persist`` (the memory tier into the root) and ``mirror`` (the root into
the mirror). The protocol and its thread (``replayer``), each channel's record beside its
source (``record``), the common files of a node copy (``common_files``).

Used by the memory tier's runner (``memory/runner.py``), the chain of replays
(``lifecycle/replication.py``, ``lifecycle/finish.py``) and the CLI (the mirror's record).
May import ``save`` and every layer below it.
"""
