"""Test helpers for the packed format's scalar tables (packed version 2).

* :func:`as_v1` -- a packed dict with its scalar tables expanded into the per-item entries that
  packed version 1 writes (``state.{fqn}.{key}``), in version 1's key order, so tests written
  against the per-item layout keep checking exactly the same keys and values;
* :func:`v1_state_keys` -- the ``state.*`` keys of that view;
* :func:`scalar_table_keys` -- the scalar-table keys of a dict;
* :func:`write_packed_v1` -- make sparse_ckpt's saves (``sparse_state_dict``, the DCP ``Stateful``)
  write packed version 1 for the rest of a test: their packed dicts go through :func:`as_v1`
  (sparse_ckpt itself writes only version 2; version 1 must stay readable).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest

import sparse_ckpt._dcp.stateful
import sparse_ckpt._save.save
from sparse_ckpt._format.keys import PACKED_PREFIX, SCALARS_PREFIX, STATE_PREFIX, owner_fqn
from sparse_ckpt._fqn import build_fqn_map
from sparse_ckpt._load.completeness import without_items_record
from sparse_ckpt._load.decode_state import decode_scalar_tables, merge_scalars

_BUILD_STATE_DICT = sparse_ckpt._save.save.build_state_dict


def scalar_table_keys(sd: Mapping[str, Any]) -> list[str]:
    """The ``state.__packed__.*`` keys of ``sd``."""
    return [k for k in sd if k.startswith(SCALARS_PREFIX)]


def as_v1(sd: Mapping[str, Any], fqns: Iterable[str] = ()) -> dict[str, Any]:
    """``sd`` as packed version 1 would have it: each FQN's scalars (tensors on CPU) as per-item
    entries right before its first other entry (FQNs with only scalars: after every other key).

    ``fqns``: every FQN of the model, to tell which FQN a per-item key belongs to when one FQN
    is a prefix of another (the scalar tables' own FQNs are always known).
    """
    tables = {k[len(SCALARS_PREFIX) :]: v for k, v in sd.items() if k.startswith(SCALARS_PREFIX)}
    if not tables:
        return dict(sd)
    scalars = merge_scalars({}, decode_scalar_tables(tables))
    known = set(fqns) | set(scalars)
    out: dict[str, Any] = {}

    def emit(fqn: str) -> None:
        for key, value in scalars.pop(fqn).items():
            out[f"{STATE_PREFIX}{fqn}.{key}"] = value

    for key, value in sd.items():
        if key.startswith(SCALARS_PREFIX):
            continue
        if key.startswith(PACKED_PREFIX):  # version 1 had no item records
            value = without_items_record(PACKED_PREFIX, key[len(PACKED_PREFIX) :], value)
        if key.startswith(STATE_PREFIX):
            fqn = owner_fqn(key[len(STATE_PREFIX) :], known)
            if fqn is not None and fqn in scalars:
                emit(fqn)
        out[key] = value
    for fqn in list(scalars):
        emit(fqn)
    return out


def v1_state_keys(sd: Mapping[str, Any], fqns: Iterable[str] = ()) -> list[str]:
    """The ``state.*`` keys of :func:`as_v1` of ``sd``."""
    return [k for k in as_v1(sd, fqns) if k.startswith(STATE_PREFIX)]


def _build_v1(
    model: Any, optimizer: Any, format: str, keying: Any, state_layout: str = "per_tensor", **kw: Any
) -> dict:
    """``build_state_dict`` as packed version 1 writes it: per-item scalars, no scalar tables
    (and one item per state tensor: version 1 had no other layout, so ``"auto"`` is per-tensor)."""
    if state_layout == "auto":
        state_layout = "per_tensor"
    sd = _BUILD_STATE_DICT(model, optimizer, format, keying, state_layout, **kw)
    if format != "packed":
        return sd
    if state_layout != "per_tensor":
        raise ValueError("packed version 1 has no state_layout='buffers'")
    return as_v1(sd, build_fqn_map(model).param_of)


def write_packed_v1(monkeypatch: pytest.MonkeyPatch, on: bool = True) -> None:
    """From now on (``on``) or no longer (``not on``), sparse_ckpt's packed saves in this test
    write packed version 1 (see the module docstring)."""
    build = _build_v1 if on else _BUILD_STATE_DICT
    for module in (sparse_ckpt._save.save, sparse_ckpt._dcp.stateful):
        monkeypatch.setattr(module, "build_state_dict", build)
