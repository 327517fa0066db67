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

import importlib
import typing

from ._version import __version__

if typing.TYPE_CHECKING:  # what the names below resolve to (type checkers and readers; at run time: `__getattr__`)
    from ._adapters import AdapterHandle, register_state_dict_adapter
    from ._backend import backend
    from ._dcp.planner import SparseLoadPlanner
    from ._dcp.safe_reader import SafeFileSystemReader
    from ._dcp.stateful import SparseOptimizerState
    from ._fqn import clear_fqn_cache
    from ._load.load import load_sparse_state_dict
    from ._multi_optimizer import MultiOptimizer
    from ._save.save import sparse_state_dict
    from .errors import (
        CheckpointFormatError,
        CheckpointMismatchError,
        CrossRankStateError,
        ReentrantSerializationError,
        SparseCheckpointError,
        UnsupportedStateDictError,
    )

_HOMES = {
    "AdapterHandle": "._adapters",
    "register_state_dict_adapter": "._adapters",
    "backend": "._backend",
    "SparseLoadPlanner": "._dcp.planner",
    "SafeFileSystemReader": "._dcp.safe_reader",
    "SparseOptimizerState": "._dcp.stateful",
    "clear_fqn_cache": "._fqn",
    "load_sparse_state_dict": "._load.load",
    "MultiOptimizer": "._multi_optimizer",
    "sparse_state_dict": "._save.save",
    "CheckpointFormatError": ".errors",
    "CheckpointMismatchError": ".errors",
    "CrossRankStateError": ".errors",
    "ReentrantSerializationError": ".errors",
    "SparseCheckpointError": ".errors",
    "UnsupportedStateDictError": ".errors",
}
"""Where each public name lives. ``import sparse_ckpt`` imports none of them (nor torch): a name is
imported from its home on first use (PEP 562), so the command-line entry points start fast."""

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


def __getattr__(name: str) -> typing.Any:
    """Import a public name from its home on first use, and keep it (later uses are plain lookups)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
