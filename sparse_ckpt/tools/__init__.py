"""Checkpoint tools: inspect, verify, diff and convert the optimizer part of a DCP checkpoint
without a model (the library side of ``python -m sparse_ckpt``; see docs/cli.md).

Each function takes checkpoint directories and returns plain data (the ``--json`` schemas).
`sparse_ckpt.tools._reader` is the shared reader (also used by `sparse_ckpt.tools.export`).
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:  # at run time: `__getattr__`
    from .convert import convert_checkpoint
    from .diff import diff_checkpoints
    from .inspect import inspect_checkpoint
    from .verify import verify_checkpoint

__all__ = ["convert_checkpoint", "diff_checkpoints", "inspect_checkpoint", "verify_checkpoint"]


def __getattr__(name: str) -> typing.Any:
    """Import a tool on first use (``python -m sparse_ckpt inspect`` imports only the inspector)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{name.split('_')[0].removesuffix('s')}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
