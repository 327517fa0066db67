"""Checkpoints as older or damaged writers leave them, for the tests that must still read or refuse them.

* :func:`legacy` -- a packed dict as sparse_ckpt wrote it before stable keys (digest keys,
  unsealed tables, scalar tables without the recorded state keys);
* :func:`drop_from_metadata` -- remove one item from a DCP checkpoint's ``.metadata``, as a
  partial copy would.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from sparse_ckpt import _backend
from sparse_ckpt._format.keys import (
    KEYS_ENTRY,
    LENS_ENTRY,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    check_table,
    packed_table_key,
    scalar_table_key,
)
from sparse_ckpt._format.tensor_parts import parts_to_tensor, tensor_to_parts
from sparse_ckpt._load.completeness import without_items_record


def legacy(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` as sparse_ckpt wrote it before stable keys: tables under ``{digest}`` keys, unsealed,
    scalar tables without the recorded state keys (and list lengths), group tables without item records."""
    core = _backend.core
    out: dict[str, Any] = {}
    for key, value in sd.items():
        if key.startswith(SCALARS_PREFIX):
            leaf, table = check_table(SCALARS_PREFIX, key[len(SCALARS_PREFIX) :], value)
            scalars, _blobs, groups = core.decode_table(leaf, table, parts_to_tensor)
            bare = [({k: v for k, v in scalars[i].items() if k not in (KEYS_ENTRY, LENS_ENTRY)}, f) for i, f in groups]
            bare = [(s, f) for s, f in bare if s]
            if bare:
                old = core.encode_table(leaf, bare, torch.Tensor, tensor_to_parts)
                out[scalar_table_key(leaf, old)] = old
        elif key.startswith(PACKED_PREFIX):
            rest = key[len(PACKED_PREFIX) :]
            leaf, table = check_table(PACKED_PREFIX, rest, without_items_record(PACKED_PREFIX, rest, value))
            out[packed_table_key(leaf, table)] = table
        else:
            out[key] = value
    return out


def drop_from_metadata(path: Path, key: str) -> None:
    """Remove ``key`` (all its chunks) from a DCP checkpoint's ``.metadata``, as a partial copy would."""
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert key in md.state_dict_metadata, sorted(md.state_dict_metadata)
    del md.state_dict_metadata[key]
    for index in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[index]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
