"""What a job's checkpoints go through around the save path: the post-commit pipeline
(``after_commit``), the replay thread (``replication``), retention passes (``pruning``) and
the end of a run (``finish``). Each collaborator receives the frozen ``Context``, never the
manager. May import every layer below ``manager``.
"""
