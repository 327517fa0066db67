"""torch DSD's two optimizer layouts, built sparsely from the live optimizers and read back.

``nested`` (DSD's default)::

    {"state": {fqn: {key: value, ...}, ...},
     "param_groups": [{setting: value, ..., "params": [fqn, ...]}, ...]}

``flat`` (``flatten_optimizer_state_dict=True``): ``state.{fqn}.{key}`` and
``param_groups.{fqn}.{setting}`` for every parameter of every group, with or without state.

Several optimizers are merged as DSD merges them: one ``state`` and one ``param_groups`` list
(flat: every state key first, then every group key). Unlike DSD, nothing is stepped first: a
parameter without state has no ``state`` entry, and its group's settings are still there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..._format.codec import encode_table
from ..._format.keys import STATE_PREFIX
from ..._format.keys_record import build_key_record
from ..._format.nested import NESTED_KEYS, nested_kind, nested_to_sparse
from ..._format.tags import Keying
from ..._fqn import FqnMap
from ..._leaves import SINGLE_LEAF, TITAN_LEAF, named_leaves
from ..._save.capture import capture_by_fqn
from ..._save.save import build_state_dict
from ..._save.state_values import check_state_values
from ...errors import CheckpointFormatError

__all__ = ["flat_state_dict", "leaves_of", "loadable", "matched_by_members", "nested_state_dict"]

STATE, PARAM_GROUPS = NESTED_KEYS
PARAMS = "params"


def leaves_of(optimizers: Sequence[torch.optim.Optimizer]) -> Any:
    """The library's optimizer argument for DSD's optimizer tuple: the optimizer itself (leaf
    ``optim``) or ``{"optim0": ..., "optim1": ...}``; thin wrappers (Accelerate's) are unwrapped
    by `sparse_ckpt._leaves.named_leaves`."""
    if len(optimizers) == 1:
        return optimizers[0]
    return {TITAN_LEAF.format(i): opt for i, opt in enumerate(optimizers)}


def nested_state_dict(fmap: FqnMap, optimizers: Any) -> dict[str, Any]:
    """DSD's nested dict of ``optimizers`` (see `leaves_of`): the state each parameter has
    (its per-parameter dict copied, the values not), every group with its settings and FQNs, and
    the key record (docs/formats.md, *Key record*), an entry DSD's own loaders do not read."""
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    all_groups: list[tuple[dict[str, Any], list[str]]] = []
    for leaf, opt in named_leaves(optimizers):
        groups_fqn, state_fqn = capture_by_fqn(leaf, opt, fmap.fqn_of)
        for fqn, values in state_fqn.items():
            state[fqn] = dict(values) if isinstance(values, Mapping) else values
        for settings, fqns in groups_fqn:
            groups.append({**settings, PARAMS: list(fqns)})
        all_groups.extend(groups_fqn)
        encode_table(leaf, groups_fqn)  # values the table codec refuses are refused here, as the flat format does
        values = (v for st in state_fqn.values() if isinstance(st, Mapping) for v in st.values())
        check_state_values(leaf, state_fqn, values)  # (the flat format checks its items)
    key, record = build_key_record(all_groups, [state])
    return {STATE: state, PARAM_GROUPS: groups, key: record}


def flat_state_dict(model: Any, optimizers: Any) -> dict[str, Any]:
    """DSD's flat dict of ``optimizers``: the library's ``flat`` format (byte for byte DSD's layout),
    state keys first, then group keys, as DSD orders them."""
    out = build_state_dict(model, optimizers, "flat", Keying.here())
    if isinstance(optimizers, torch.optim.Optimizer):
        return out
    state = {k: v for k, v in out.items() if k.startswith(STATE_PREFIX)}
    return {**state, **{k: v for k, v in out.items() if k not in state}}


def matched_by_members(osd: Mapping[str, Any], optimizers: Any, fmap: FqnMap) -> Mapping[str, Any]:
    """A nested dict ``osd`` as this rank's ``optimizers`` (see `leaves_of`) read it, groups matched
    by their members as torch DSD matches them; any other dict as it is.

    DCP keeps one rank's copy of a replicated item, so ``param_groups.N.params`` of a checkpoint saved
    by ranks whose optimizers hold different parameters (Megatron-FSDP's empty shards, any
    rank-asymmetric optimizer) lists one rank's parameters. As DSD, each live group takes the saved
    group that lists any of its members: a member the saved group does not list is added to it (a copy;
    ``osd`` is not changed), and the saved state of a model parameter that no saved group lists and no
    optimizer here holds (another rank's, whose list was not kept) is left out, as DSD ignores
    entries of parameters outside the optimizers. A live group none of whose members is listed stays
    unmatched (refused as missing under ``strict``)."""
    groups, state = osd.get(PARAM_GROUPS), osd.get(STATE, {})
    if not isinstance(groups, list) or not isinstance(state, Mapping) or nested_kind({STATE: state, **osd}) != "fqn":
        return osd
    listed: dict[str, int] = {}
    for gi, group in enumerate(groups):
        params = group.get(PARAMS) if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)):
            return osd  # not DSD's layout: the loader names what is wrong
        for fqn in params:
            if isinstance(fqn, str):
                listed.setdefault(fmap.resolve(fqn), gi)
    added: dict[int, list[str]] = {}
    held: set[str] = set()
    for _leaf, opt in named_leaves(optimizers):
        for group in opt.param_groups:
            fqns = [f for p in group[PARAMS] if (f := fmap.fqn_of.get(id(p))) is not None]
            held.update(fqns)
            gi = next((listed[f] for f in fqns if f in listed), None)
            for fqn in fqns if gi is not None else ():
                if fqn not in listed:
                    added.setdefault(gi, []).append(fqn)
                    listed[fqn] = gi
    others = [
        k
        for k in state
        if isinstance(k, str) and (f := fmap.resolve(k)) not in listed and f not in held and f in fmap.param_of
    ]
    if not added and not others:
        return osd
    out = dict(osd)
    out[PARAM_GROUPS] = [{**g, PARAMS: [*g[PARAMS], *added[gi]]} if gi in added else g for gi, g in enumerate(groups)]
    if others:
        out[STATE] = {k: v for k, v in state.items() if k not in others}
    return out


def loadable(osd: Mapping[str, Any]) -> dict[str, Any]:
    """What the library's loader reads for a DSD optimizer dict: the nested layout rewritten into
    the packed equivalent (one leaf, every group in order), a flat or sparse_ckpt dict as it is.

    A nested dict without state has no ``state`` entry after ``dcp.load`` (DCP saves nothing for
    an empty dict): ``param_groups`` alone is read as the nested layout with empty state."""
    if isinstance(osd.get(PARAM_GROUPS), list) and STATE not in osd:
        osd = {STATE: {}, **osd}
    kind = nested_kind(osd)
    if kind == "fqn":
        return nested_to_sparse(osd, leaf=SINGLE_LEAF)
    if kind == "ids":
        raise CheckpointFormatError(
            "the optimizer dict is keyed by parameter ids (torch's Optimizer.state_dict()), not by FQN as DSD's: "
            "load it with optimizer.load_state_dict"
        )
    return dict(osd)
