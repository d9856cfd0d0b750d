"""dist_ckpt checkpoints for Lightning's FSDP2 strategy (extra ``[lightning]``; docs/integrations.md).

- :class:`DistCkptStrategy` (``lightning.pytorch.Trainer``) and
  :class:`DistCkptFabricStrategy` (``lightning.fabric.Fabric``): subclasses of the two
  ``ModelParallelStrategy`` classes taking ``checkpoint_config=CheckpointConfig(...)``; their
  saves and loads are dist_ckpt generations under ``checkpoint_config.root`` (a local path or
  an ``s3://`` URL; ``DIST_CKPT_ROOT`` under ``python -m launch``).
- A path given to a save is a label; a load takes the root, ``"last"`` or a generation name
  (the newest committed); nothing is removed by a path. The rules:
  :mod:`dist_ckpt.integrations.lightning_common`.
- Mid-epoch resume is exact with a :class:`~dist_ckpt.integrations.data.ResumableLoader` as the
  train dataloader: the Trainer's fit loop saves and restores its position (it is ``Stateful``)
  and counts the batches of the epoch already done; in Fabric, put it in the state dict.

``Trainer``::

    strategy = DistCkptStrategy(CheckpointConfig(root="s3://bucket/run1"),
                                data_parallel_size=2, tensor_parallel_size=1)
    trainer = Trainer(strategy=strategy, callbacks=[ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model)     # resumes from the newest generation; DONE.json at the end

``Fabric``::

    strategy = DistCkptFabricStrategy(parallelize, CheckpointConfig(root=...))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    fabric.load(strategy.checkpoint_config.root, state)     # a fresh root: nothing loaded
    ...  fabric.save(strategy.checkpoint_config.root, state) every N steps ...
    strategy.finish(state)
"""

from __future__ import annotations

from .lightning_fabric import DistCkptFabricStrategy
from .lightning_trainer import DistCkptStrategy

__all__ = ["DistCkptFabricStrategy", "DistCkptStrategy"]
