"""sparse_ckpt: exact, sparse optimizer checkpoints for torch.distributed.checkpoint.

Public API:

* save and load: `sparse_state_dict`, `load_sparse_state_dict`, `MultiOptimizer`,
  `register_state_dict_adapter` (and its `AdapterHandle`);
* DCP: `SparseOptimizerState` (a Stateful), `SparseLoadPlanner` and `SafeFileSystemReader`;
* errors: `SparseCheckpointError` and its subclasses `UnsupportedStateDictError`,
  `ReentrantSerializationError`, `CheckpointMismatchError` (and its
  `CrossRankStateError`), `CheckpointFormatError`;
* `clear_fqn_cache` (drop the FQN maps kept between calls), `backend` (``"cpp"`` or
  ``"python"``) and ``__version__``.

Submodules: `sparse_ckpt.tools` (the checkpoint tools behind ``python -m sparse_ckpt``) and
`sparse_ckpt.export` (pickle-free safetensors + JSON export).
"""

from __future__ import annotations

from ._adapters import AdapterHandle, register_state_dict_adapter
from ._backend import backend
from ._dcp.planner import SparseLoadPlanner
from ._dcp.safe_reader import SafeFileSystemReader
from ._dcp.stateful import SparseOptimizerState
from ._fqn import clear_fqn_cache
from ._load.load import load_sparse_state_dict
from ._multi_optimizer import MultiOptimizer
from ._save.save import sparse_state_dict
from ._version import __version__
from .errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    CrossRankStateError,
    ReentrantSerializationError,
    SparseCheckpointError,
    UnsupportedStateDictError,
)

__all__ = [
    "AdapterHandle",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CrossRankStateError",
    "MultiOptimizer",
    "ReentrantSerializationError",
    "SafeFileSystemReader",
    "SparseCheckpointError",
    "SparseLoadPlanner",
    "SparseOptimizerState",
    "UnsupportedStateDictError",
    "__version__",
    "backend",
    "clear_fqn_cache",
    "load_sparse_state_dict",
    "register_state_dict_adapter",
    "sparse_state_dict",
]
