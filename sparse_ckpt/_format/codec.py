"""The group-table codec as every reader and writer of tables calls it: tensors in settings as
their parts (:func:`~sparse_ckpt._format.tensor_parts.tensor_to_parts`), ``torch.dtype`` and
``torch.device`` values as named values (:func:`~sparse_ckpt._format.tensor_parts.value_to_name`),
so no caller can write or read a table without them. Format: docs/formats.md ("Table codec")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _backend
from .tensor_parts import name_to_value, parts_to_tensor, tensor_to_parts, value_to_name


def encode_settings(leaf: str, group_index: int, settings: dict[str, Any]) -> bytes:
    """``core.encode_settings`` of one group's settings."""
    return _backend.core.encode_settings(leaf, group_index, settings, torch.Tensor, tensor_to_parts, value_to_name)


def encode_table(leaf: str, groups_fqn: list[tuple[dict, list[str]]]) -> bytes:
    """``core.encode_table`` of a leaf's groups (version 1, or 2 when a setting is a named value)."""
    return _backend.core.encode_table(leaf, groups_fqn, torch.Tensor, tensor_to_parts, value_to_name)


def decode_table(
    leaf: str, data: bytes, from_parts: Callable[[str, tuple[int, ...], str, bytes], Any] = parts_to_tensor
) -> tuple[list[dict], list[bytes], list[tuple[int, list[str]]]]:
    """``core.decode_table`` of a table of either version: ``(settings, settings_blobs, groups)``."""
    return _backend.core.decode_table(leaf, data, from_parts, name_to_value)
