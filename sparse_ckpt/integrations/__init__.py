"""Glue for the trainers users run sparse_ckpt with.

:mod:`.dsd` serves every trainer built on torch DSD (``torch.distributed.checkpoint.state_dict``):
DSD's functions, exact and sparse, and ``install()``. The other modules are one per trainer
(``veomni``, ``torchtitan``, ``accelerate``); each imports its trainer lazily (only when one of its
functions runs; ``torchtitan``, whose ``SparseCheckpointManager`` subclasses torchtitan's manager,
when the module itself is imported), so ``sparse_ckpt`` never needs a trainer package installed,
and none changes how a checkpoint looks on disk.
"""
