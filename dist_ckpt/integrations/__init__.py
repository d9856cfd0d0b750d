"""dist_ckpt inside the trainers users already run (docs/integrations.md).

- :mod:`dist_ckpt.integrations.data`: the project's resumable sampler behind a
  ``torch.utils.data.DataLoader``, for any loop or trainer.
- :mod:`dist_ckpt.integrations.hf`: ``DistCkptTrainer``, a drop-in for ``transformers.Trainer``
  (extra ``[hf]``).
- :mod:`dist_ckpt.integrations.lightning`: ``DistCkptStrategy`` and ``DistCkptFabricStrategy``
  (extra ``[lightning]``).

Each trainer module imports its trainer; this package imports none of them.
"""
