"""sparse_ckpt: exact, sparse optimizer checkpoints for torch.distributed.checkpoint.

Public API: :func:`sparse_state_dict`, :func:`load_sparse_state_dict`, :class:`MultiOptimizer`,
:func:`register_state_dict_adapter`, the error classes, and :func:`backend`.
"""

from __future__ import annotations

from ._backend import backend
from .adapters import AdapterHandle, register_state_dict_adapter
from .dcp import SparseLoadPlanner, SparseOptimizerState
from .errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    ReentrantSerializationError,
    SparseCheckpointError,
    UnsupportedStateDictError,
)
from .load import load_sparse_state_dict
from .multi_optimizer import MultiOptimizer
from .save import sparse_state_dict

__version__ = "0.1.0"

__all__ = [
    "AdapterHandle",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "MultiOptimizer",
    "ReentrantSerializationError",
    "SparseCheckpointError",
    "SparseLoadPlanner",
    "SparseOptimizerState",
    "UnsupportedStateDictError",
    "backend",
    "load_sparse_state_dict",
    "register_state_dict_adapter",
    "sparse_state_dict",
]
