"""sparse_ckpt: exact, sparse optimizer checkpoints for torch.distributed.checkpoint.

Public API:

* save and load: :func:`sparse_state_dict`, :func:`load_sparse_state_dict`, :class:`MultiOptimizer`,
  :func:`register_state_dict_adapter` (and its :class:`AdapterHandle`);
* DCP: :class:`SparseOptimizerState` (a Stateful) and :class:`SparseLoadPlanner`;
* checkpoint tools (the library side of ``python -m sparse_ckpt``): :func:`inspect_checkpoint`,
  :func:`verify_checkpoint`, :func:`diff_checkpoints`, :func:`convert_checkpoint`, and
  :class:`UsageError` (a bad argument or destination);
* pickle-free export (safetensors + JSON): :func:`export_checkpoint`, :func:`load_export`,
  :func:`read_export` (``safetensors`` is imported only when one of them runs);
* errors: :class:`SparseCheckpointError` and its subclasses :class:`UnsupportedStateDictError`,
  :class:`ReentrantSerializationError`, :class:`CheckpointMismatchError` (and its
  :class:`CrossRankStateError`), :class:`CheckpointFormatError`;
* :func:`clear_fqn_cache` (drop the FQN maps kept between calls), :func:`backend` (``"cpp"`` or
  ``"python"``) and ``__version__``.
"""

from __future__ import annotations

from ._backend import backend
from ._version import __version__
from .adapters import AdapterHandle, register_state_dict_adapter
from .checkpoint_tools import UsageError, convert_checkpoint, diff_checkpoints, inspect_checkpoint, verify_checkpoint
from .dcp import SparseLoadPlanner, SparseOptimizerState
from .errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    CrossRankStateError,
    ReentrantSerializationError,
    SparseCheckpointError,
    UnsupportedStateDictError,
)
from .export import export_checkpoint, load_export, read_export
from .fqn import clear_fqn_cache
from .load import load_sparse_state_dict
from .multi_optimizer import MultiOptimizer
from .save import sparse_state_dict

__all__ = [
    "AdapterHandle",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CrossRankStateError",
    "MultiOptimizer",
    "ReentrantSerializationError",
    "SparseCheckpointError",
    "SparseLoadPlanner",
    "SparseOptimizerState",
    "UnsupportedStateDictError",
    "UsageError",
    "__version__",
    "backend",
    "clear_fqn_cache",
    "convert_checkpoint",
    "diff_checkpoints",
    "export_checkpoint",
    "inspect_checkpoint",
    "load_export",
    "load_sparse_state_dict",
    "read_export",
    "register_state_dict_adapter",
    "sparse_state_dict",
    "verify_checkpoint",
]
