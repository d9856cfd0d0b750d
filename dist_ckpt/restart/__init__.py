"""What a restart needs: the train state and its parts (RNG streams, sampler position,
the experiment contract) and their byte encoding.

Owns: ``TrainState`` and the per-rank / global state it captures. May import: ``errors``,
``logs``. Knows nothing of storage, ranks or generations.
"""
