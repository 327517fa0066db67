"""Checkpoint tools: inspect, verify, diff and convert the optimizer part of a DCP checkpoint
without a model (the library side of ``python -m sparse_ckpt``; see docs/cli.md).

Each function takes checkpoint directories and returns plain data (the ``--json`` schemas).
`sparse_ckpt.tools._reader` is the shared reader (also used by `sparse_ckpt.tools.export`).
"""

from __future__ import annotations

from .convert import convert_checkpoint
from .diff import diff_checkpoints
from .inspect import inspect_checkpoint
from .verify import verify_checkpoint

__all__ = ["convert_checkpoint", "diff_checkpoints", "inspect_checkpoint", "verify_checkpoint"]
