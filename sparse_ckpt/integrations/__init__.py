"""Glue for the trainers users run sparse_ckpt with, one module per trainer.

Each module imports its trainer lazily (only when one of its functions runs; ``torchtitan``, whose
``SparseCheckpointManager`` subclasses torchtitan's manager, when the module itself is imported),
so ``sparse_ckpt`` never needs a trainer package installed, and none changes how a checkpoint looks
on disk.
"""
