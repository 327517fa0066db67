"""Which param-group values a copy may share: the immutable ones ``copy.deepcopy`` returns as they
are. One definition for the semantic layer (:mod:`sparse_ckpt._load.apply`) and the Python core
(:mod:`sparse_ckpt._core_py.load_assembly`, whose C++ twin tests the same exact types)."""

from __future__ import annotations

from typing import Any

IMMUTABLE_TYPES = frozenset((int, float, bool, str, bytes, type(None)))
"""Exact types of immutable scalars (subclasses are not included: they may carry mutable state)."""


def is_immutable(value: Any) -> bool:
    """An exact immutable scalar, or a tuple of them (``deepcopy`` returns such values as they are)."""
    kind = type(value)
    return kind in IMMUTABLE_TYPES or (kind is tuple and all(type(v) in IMMUTABLE_TYPES for v in value))
