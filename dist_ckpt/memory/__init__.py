"""The node memory tier's runtime (``CheckpointConfig(memory_tier=True)``): one package.

Owns everything that knows about shared memory, rings and peers: where a run's memory lives
on a node (``paths``), the tier over it (``tier``), the persistence of in-memory generations
to the root and memory retention (``runner``), the ring of node copies across nodes (``ring``:
replication in ``replicas``, the restore exchange routed in ``routes`` and run in ``exchange``)
and the file channel between node leaders over torch.distributed (``peer``). Nothing outside
this package names a ring, a peer or a shared-memory path; the manager talks to
``MemoryTierRunner`` only.
May import every layer below ``lifecycle`` (docs/architecture.md, "Layers").
"""
