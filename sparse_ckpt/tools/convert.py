"""``convert``: rewrite the optimizer part of a checkpoint between packed and flat format.

``--to flat`` turns scalar tables into per-item state (DSD's layout); ``--to packed`` keeps
state entries as they are (a flat source's per-item state stays per item, which every reader
reads) and adds the foreign-loader guards sparse_ckpt's Stateful writes. Every other entry of
the checkpoint is copied unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp

from .. import _backend
from .._dcp.metadata import find_optimizers, metadata_path, set_path
from .._format.keys import (
    BUFFERS_PREFIX,
    GROUPS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    foreign_guard_keys,
    foreign_guard_value,
    has_escaped_part,
    is_state_item,
)
from .._layouts.bucketed_view import full_state
from .._leaves import SINGLE_LEAF
from .._load.completeness import without_items_record
from ..errors import CheckpointFormatError, CheckpointMismatchError, UsageError
from ._reader import (
    FLAT_LEAF_IN_MIXED,
    check_new_dir,
    expand_scalar_tables,
    open_checkpoint,
    pack_flat_groups,
    read_entries,
    select_optimizers,
    sparse_values,
    split_optimizer,
)

__all__ = ["convert_checkpoint", "convert_optimizer"]


def convert_optimizer(
    values: Mapping[str, Any], to: str, *, leaf: str = SINGLE_LEAF, drop_empty_groups: bool = False
) -> dict[str, Any]:
    """One optimizer's entries rewritten in format ``to``; state and unknown entries are kept,
    buffered state (``state_layout="buffers"``) as per-item state of full tensors (``values``
    must then hold the buffers themselves)."""
    core = _backend.core
    leaves, flat, _state, _unmatched = split_optimizer(values)
    buffer_keys = [k for k in values if k.startswith(BUFFERS_PREFIX)]
    if buffer_keys:  # per-item state again, each tensor whole (keys as the packed format writes them)
        known = {f for groups in leaves.values() for g in groups for f in g.fqns} | {f for g in flat for f in g.fqns}
        expanded = core.flatten_state("(buffers)", full_state(buffer_keys, values), known, True)
        values = {**{k: v for k, v in values.items() if not k.startswith(BUFFERS_PREFIX)}, **expanded}
    out = {k: v for k, v in values.items() if not k.startswith(GROUPS_PREFIX)}
    if to == "flat":
        # DSD's layout has no tables: scalars become per-item state again (each FQN's first).
        out = {
            **expand_scalar_tables(values, flat=True),
            **{k: v for k, v in out.items() if not k.startswith(SCALARS_PREFIX)},
        }
        escaped = [k for k in values if is_state_item(k) and has_escaped_part(k)]
        if escaped and leaves:
            raise CheckpointFormatError(
                f"state key {escaped[0]!r} has an escaped part (a state key that is not a plain str, or nested "
                "state that reads as another FQN): the flat layout cannot hold it"
            )
        seen: dict[str, bytes] = {}
        for name, groups in leaves.items():
            for gi, group in enumerate(groups):
                if not group.fqns:
                    if drop_empty_groups:
                        continue
                    raise CheckpointMismatchError(
                        f"leaf {name!r} group {gi} has no parameters; flat format cannot express it "
                        "(pass --drop-empty-groups to drop it)"
                    )
                if group.settings_vary:
                    raise CheckpointMismatchError(
                        f"leaf {name!r} group {gi}: ranks' tables hold different settings for this group"
                    )
                for fqn in group.fqns:
                    prev = seen.setdefault(fqn, group.blob)
                    if prev != group.blob:
                        raise CheckpointMismatchError(f"conflicting saved settings for parameter {fqn!r}")
                out.update(core.flatten_groups(name, [(group.settings, group.fqns)]))
        for group in flat:
            out.update(core.flatten_groups(FLAT_LEAF_IN_MIXED, [(group.settings, group.fqns)]))
    elif to == "packed":
        for key, value in values.items():
            if key.startswith(PACKED_PREFIX):
                out[key] = value
        if flat:
            out.update(pack_flat_groups(flat, leaf, leaves))
        # what sparse_ckpt's Stateful writes: guards that make loaders that do not know the format fail
        firsts = [next((f for g in groups for f in g.fqns), None) for groups in (*leaves.values(), flat)]
        out.update(dict.fromkeys(foreign_guard_keys([f for f in firsts if f is not None]), foreign_guard_value()))
    else:
        raise UsageError(f"--to must be 'packed' or 'flat', got {to!r}")
    # The converted checkpoint holds other items than the save recorded (buffers became per-item state).
    for key, value in out.items():
        for prefix in (PACKED_PREFIX, SCALARS_PREFIX):
            if key.startswith(prefix):
                out[key] = without_items_record(prefix, key[len(prefix) :], value)
    return out


def convert_checkpoint(
    src: str,
    dst: str,
    to: str,
    *,
    key: str | None = None,
    leaf: str = SINGLE_LEAF,
    drop_empty_groups: bool = False,
    fqns: list[str] | None = None,
) -> list[str]:
    """Write ``src`` to ``dst`` with its optimizer part in format ``to``; returns the keys converted.

    A torch ``optimizer.state_dict()`` (int ids) is converted by FQN: ``fqns`` names its parameters in
    the optimizer's order (else its groups' saved ``param_names``; else a `UsageError` says what is needed)."""
    metadata = open_checkpoint(src)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("SRC and DST must differ")
    check_new_dir(dst)
    opts = select_optimizers(find_optimizers(metadata), key)
    if not opts:
        raise UsageError(f"{src!r} holds no optimizer entries ('<key>.state.*' / '<key>.param_groups.*')")
    converted = {flat for opt in opts for flat in (*opt.inner.values(), *opt.guards)}
    others = [k for k in metadata.state_dict_metadata if k not in converted]
    everything = read_entries(src, metadata, metadata.state_dict_metadata.keys(), unpickle_keys=set(others))
    new_opts = []
    for opt in opts:
        values = sparse_values(
            opt, {inner: everything[flat] for inner, flat in opt.inner.items()}, fqns, placeholders=False
        )
        new_opts.append((opt.prefix, convert_optimizer(values, to, leaf=leaf, drop_empty_groups=drop_empty_groups)))
    nested: dict[str, Any] = {}
    for flat_key in others:
        set_path(nested, metadata_path(metadata, flat_key), everything[flat_key])
    for prefix, entries in new_opts:
        for inner, value in entries.items():
            set_path(nested, (*prefix, inner), value)
    os.makedirs(dst, exist_ok=True)
    dcp.save(nested, checkpoint_id=dst, no_dist=True)
    return [opt.name for opt in opts]
