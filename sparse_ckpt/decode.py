"""Decode a sparse/flat optimizer dict into ``fqn -> settings`` and ``fqn -> state``.

Settings are *interned*: equal settings (equal encoded bytes) are one dict object, so the core
can compare them by identity. Aliases of tied parameters resolve to their canonical FQN.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _backend
from ._tensor_parts import parts_to_tensor, tensor_to_parts
from .errors import CheckpointFormatError, CheckpointMismatchError
from .format import PACKED_PREFIX, split_table_key, table_digest
from .fqn import FqnMap


@dataclass
class DecodedCheckpoint:
    """Everything a load needs from a checkpoint's optimizer entries."""

    settings_of: dict[str, dict] = field(default_factory=dict)
    """Canonical FQN -> interned settings."""
    state_of: dict[str, dict] = field(default_factory=dict)
    """Canonical FQN -> saved state (nested dicts)."""
    empty_groups: dict[tuple[str, int], dict] = field(default_factory=dict)
    """``(leaf, group index)`` -> settings of a group without parameters (packed format only)."""
    table_leaf_of: dict[str, str] = field(default_factory=dict)
    """Canonical FQN -> leaf of the packed table that carried its settings."""
    table_leaves: list[str] = field(default_factory=list)
    """Leaf names of all packed tables, in order of appearance."""
    has_tables: bool = False
    unmatched_keys: list[str] = field(default_factory=list)
    """Keys that are neither state of a known FQN nor param-group entries."""
    names_of: dict[str, str | None] = field(default_factory=dict)
    """Canonical FQN -> its entry in its saved group's ``param_names`` (torch's named parameters),
    for FQNs whose saved group had ``param_names``; ``None`` when the entry is not known.
    ``param_names`` is per-parameter metadata, so it is kept out of the interned settings: two
    groups that differ only in their names do not conflict, and names follow FQNs on load."""
    names_list_of: dict[str, list] = field(default_factory=dict)
    """Flat format: canonical FQN -> its saved group's whole ``param_names`` list (DSD's flat layout
    repeats the list for every FQN of the group, without positions)."""


def fmt_list(items: list[str], limit: int = 10) -> str:
    """``'a', 'b', ... (+N more)`` -- the first ``limit`` items and a count of the rest."""
    shown = ", ".join(repr(x) for x in items[:limit])
    more = len(items) - limit
    return f"{shown} (+{more} more)" if more > 0 else shown


def decode_checkpoint(state_dict: Mapping[str, Any], fmap: FqnMap) -> DecodedCheckpoint:
    """Split and decode ``state_dict`` (packed and/or flat entries) against ``fmap``.

    State keys are resolved against the checkpoint's own FQNs (those its tables or flat
    param-group entries list, and the model's aliases of them), never against the target model's
    other FQNs, so one parameter's state can never land on another whose FQN is a prefix of the
    saved key.
    """
    _refuse_other_layouts(state_dict)
    core = _backend.core
    decoded: list[tuple[str, str, list[dict], list[bytes], list[tuple[int, list[str]]]]] = []

    def table_fqns(tables: dict[str, bytes]) -> set[str]:
        fqns: set[str] = set()
        for rest, table in tables.items():
            leaf, digest = split_table_key(rest)
            if table_digest(table) != digest:
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: group table '{PACKED_PREFIX}{rest}' does not match its digest "
                    "(corrupt or edited checkpoint)"
                )
            settings, blobs, groups = core.decode_table(leaf, table, parts_to_tensor)
            decoded.append((rest, leaf, settings, blobs, groups))
            for _idx, group_fqns in groups:
                fqns.update(group_fqns)
        if len(fmap.canonical) > len(fmap.param_of):  # the model has aliases (tied or wrapped names)
            saved = {fmap.resolve(f) for f in fqns}
            fqns.update(alias for alias, canon in fmap.canonical.items() if canon in saved)
        return fqns

    settings_raw, state_raw, _tables, unmatched = core.unflatten(state_dict, table_fqns)
    out = DecodedCheckpoint(unmatched_keys=list(unmatched), has_tables=bool(decoded))
    interned: dict[bytes, dict] = {}
    source_of: dict[str, str] = {}

    def intern(blob: bytes, settings: dict) -> dict:
        return interned.setdefault(blob, settings)

    def put_settings(fqn: str, settings: dict, source: str) -> str:
        """Record ``settings`` for ``fqn``; returns its canonical FQN."""
        canon = fmap.resolve(fqn)
        prev = out.settings_of.get(canon)
        if prev is None:
            out.settings_of[canon] = settings
            source_of[canon] = source
        elif prev is not settings:
            raise CheckpointMismatchError(
                f"conflicting saved settings for parameter {canon!r}: {source_of[canon]} and {source} differ"
            )
        return canon

    for _rest, leaf, settings, blobs, groups in decoded:
        if leaf not in out.table_leaves:
            out.table_leaves.append(leaf)
        unnamed: dict[int, dict] = {}
        for gi, (idx, fqns) in enumerate(groups):
            if fqns and "param_names" in settings[idx]:
                s = unnamed.get(idx)
                if s is None:
                    bare = {k: v for k, v in settings[idx].items() if k != "param_names"}
                    blob = core.encode_settings(leaf, gi, bare, torch.Tensor, tensor_to_parts)
                    s = unnamed[idx] = intern(blob, bare)
                names = settings[idx]["param_names"]
                positional = isinstance(names, (list, tuple)) and len(names) == len(fqns)
                for i, fqn in enumerate(fqns):
                    name = names[i] if positional else None
                    out.names_of.setdefault(fmap.resolve(fqn), name if isinstance(name, str) else None)
            else:
                s = intern(blobs[idx], settings[idx])
            if not fqns:
                prev = out.empty_groups.setdefault((leaf, gi), s)
                if prev is not s:
                    raise CheckpointMismatchError(
                        f"leaf {leaf!r} group {gi}: tables of different ranks disagree on this empty group's settings"
                    )
            # A parameter may sit in two groups of one leaf (torch allows it): the settings must agree.
            source = f"table of leaf {leaf!r} group {gi}"  # once per group, not per parameter
            for fqn in fqns:
                out.table_leaf_of.setdefault(put_settings(fqn, s, source), leaf)

    for fqn, raw in settings_raw.items():
        if "param_names" in raw:  # DSD's flat layout repeats the group's whole list for each FQN
            names = raw["param_names"]
            raw = {k: v for k, v in raw.items() if k != "param_names"}
            name = None
            if isinstance(names, (list, tuple)):
                name = fqn if fqn in names else names[0] if len(names) == 1 else None
                out.names_list_of[fmap.resolve(fqn)] = list(names)
            out.names_of.setdefault(fmap.resolve(fqn), name if isinstance(name, str) else None)
        blob = core.encode_settings(f"flat:{fqn}", 0, raw, torch.Tensor, tensor_to_parts)
        put_settings(fqn, intern(blob, raw), f"flat entries of {fqn!r}")

    for fqn, state in state_raw.items():
        canon = fmap.resolve(fqn)
        if canon in out.state_of:
            raise CheckpointMismatchError(
                f"parameter {canon!r} has saved state under two names ({fqn!r} is an alias)"
            )
        out.state_of[canon] = state
    return out


def _refuse_other_layouts(state_dict: Mapping[str, Any]) -> None:
    """A torch ``Optimizer.state_dict()`` (or DSD's nested one) is not a sparse dict: say so."""
    if not (isinstance(state_dict, Mapping) and "state" in state_dict and "param_groups" in state_dict):
        return
    state, groups = state_dict["state"], state_dict["param_groups"]
    if not (isinstance(state, Mapping) and isinstance(groups, (list, tuple))):
        return
    keys = list(state)[:1] + [p for g in groups[:1] if isinstance(g, Mapping) for p in list(g.get("params", []))[:1]]
    if any(isinstance(k, int) for k in keys) or (not keys and all(isinstance(g, Mapping) for g in groups)):
        raise CheckpointFormatError(
            "this is a torch.optim.Optimizer.state_dict() (int-keyed 'state' and a 'param_groups' list), not a "
            "sparse_ckpt dict: load it with optimizer.load_state_dict(sd), or save with "
            "sparse_ckpt.sparse_state_dict(model, optimizer) to get a dict load_sparse_state_dict reads"
        )
    raise CheckpointFormatError(
        "this is a nested FQN-keyed optimizer dict ('state' and 'param_groups' entries, as torch DSD's "
        "get_optimizer_state_dict returns without flatten_optimizer_state_dict=True), not a sparse_ckpt dict: "
        "load it with torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, or produce a flat one "
        "with StateDictOptions(flatten_optimizer_state_dict=True), which load_sparse_state_dict reads"
    )
