"""Pickle-free export of a checkpoint's optimizer part (safetensors + JSON) and its loader: the
public name of `sparse_ckpt.tools.export`, where it lives with the other checkpoint tools."""

from __future__ import annotations

from .tools.export import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    MANIFEST_FILE,
    TENSORS_FILE,
    ExportSummary,
    export_checkpoint,
    load_export,
    read_export,
)

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_VERSION",
    "MANIFEST_FILE",
    "TENSORS_FILE",
    "ExportSummary",
    "export_checkpoint",
    "load_export",
    "read_export",
]
