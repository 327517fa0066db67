"""A torch ``Optimizer.state_dict()`` (int ids) loaded by position, as torch's own ``load_state_dict`` does.

What users already have: ``dcp.save({"optim": optimizer.state_dict()})`` writes torch's packed
dict, whose ``state`` is keyed by int ids (strings once DCP has read them back) and whose groups
list ``params`` as ids. It names no parameter, so it can only be loaded the way torch loads it:
the saved groups, in order, onto the target's groups, in order (a `sparse_ckpt.MultiOptimizer`'s
leaves one after the other), the i-th id of a saved group onto the i-th parameter of the target
group. That is done only where it provably fits -- as many groups, as many parameters in each
group, every saved state tensor shaped like the parameter it lands on -- and then the dict is
rewritten into the FQN-keyed equivalent (one packed table per target leaf), which every other rule
of the load then treats like any checkpoint. Anything else is refused, saying what the dict is and
what would load it. A `~sparse_ckpt.errors.PositionalLoadWarning` says that positions were used.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .._format.nested import NESTED_KEYS, nested_kind, nested_to_sparse
from .._fqn import FqnMap
from ..errors import CheckpointMismatchError, PositionalLoadWarning, UsageError

__all__ = ["POSITION_MARK", "is_positional", "named_by_position", "positional_to_sparse", "with_state_entry"]

POSITION_MARK = "#"
"""How the tools name a parameter of a torch dict they have no name for: ``#<id>`` (``inspect``)."""

PARAMS = "params"

WHAT_IT_IS = (
    "the checkpoint holds a torch optimizer.state_dict() (int parameter ids, no parameter names), which "
    "loads only by position"
)


def with_state_entry(sd: Mapping[str, Any]) -> Mapping[str, Any]:
    """``sd`` with an empty ``state`` when it is a nested optimizer dict without one: what DCP reads
    back of a torch or DSD nested dict saved before any state existed (DCP writes no item for an
    empty dict), which is still that optimizer's groups."""
    if NESTED_KEYS[1] in sd and NESTED_KEYS[0] not in sd and isinstance(sd[NESTED_KEYS[1]], (list, tuple)):
        return {NESTED_KEYS[0]: {}, **sd}
    return sd


def is_positional(sd: Mapping[str, Any]) -> bool:
    """Whether ``sd`` is a torch ``Optimizer.state_dict()`` (int ids; str digits after a DCP round trip)."""
    return nested_kind(sd) == "ids"


def _saved_id(key: Any) -> int | None:
    """A state key as the int id it stands for (DCP reads dict keys back as str), else ``None``."""
    if type(key) is int:
        return key
    if isinstance(key, str) and key.isdigit() and (key == "0" or not key.startswith("0")):
        return int(key)
    return None


def _shape_text(groups: list[list[Any]]) -> str:
    return "[" + ", ".join(str(len(g)) for g in groups) + "]"


def _refuse(detail: str, saved_sizes: list[list[Any]]) -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"{WHAT_IT_IS}: {detail}. It loads into an optimizer built the way the saved one was: "
        f"{len(saved_sizes)} param group(s) of {_shape_text(saved_sizes)} parameters, in the order they were "
        "passed to the optimizer (sparse_ckpt then loads it by position, or optimizer.load_state_dict loads it)"
    )


def named_by_position(sd: Mapping[str, Any], fqns: list[str] | None, *, placeholders: bool) -> dict[str, Any]:
    """A torch ``Optimizer.state_dict()`` ``sd`` as DSD's nested FQN-keyed dict: the i-th parameter of
    its groups (in order) named ``fqns[i]``; without ``fqns``, by the groups' saved ``param_names``
    where every group has them; else ``#<id>`` (`POSITION_MARK`) with ``placeholders``, or a
    `UsageError` saying what is needed (the checkpoint tools)."""
    groups, state = sd[NESTED_KEYS[1]], sd[NESTED_KEYS[0]]
    ids = [list(g.get(PARAMS, ())) if isinstance(g, Mapping) else [] for g in groups]
    count = sum(map(len, ids))
    if fqns is None and groups and all(isinstance(g, Mapping) and "param_names" in g for g in groups):
        fqns = [n for g in groups for n in g["param_names"]]
    if fqns is not None and len(fqns) != count:
        raise UsageError(
            f"{len(fqns)} FQN(s) given for the {count} parameter(s) of the torch optimizer.state_dict() "
            f"(groups of {_shape_text(ids)}): give one FQN per parameter, in the optimizer's order"
        )
    if fqns is None:
        if not placeholders:
            raise UsageError(
                f"{WHAT_IT_IS}: converting it needs the FQNs of its {count} parameter(s) in the optimizer's order "
                f"(groups of {_shape_text(ids)}): pass --fqns FILE, one FQN per line, e.g. written by "
                "[name for g in optimizer.param_groups for p in g['params'] for name, q in model.named_parameters() "
                "if q is p]"
            )
        fqns = [f"{POSITION_MARK}{i}" for g in ids for i in g]
    name_of: dict[Any, str] = {}
    it = iter(fqns)
    out_groups = []
    for g, g_ids in zip(groups, ids):
        names = [name_of.setdefault(i, next(it)) for i in g_ids]
        out_groups.append({**{k: v for k, v in g.items() if k != PARAMS}, PARAMS: names})
    out_state = {}
    for key, value in state.items():
        sid = _saved_id(key)
        if sid not in name_of:
            raise CheckpointMismatchError(f"{WHAT_IT_IS}: state entry {key!r} belongs to no id of its param groups")
        out_state[name_of[sid]] = value
    return {NESTED_KEYS[0]: out_state, NESTED_KEYS[1]: out_groups}


def positional_to_sparse(
    sd: Mapping[str, Any], leaves: list[tuple[str, torch.optim.Optimizer]], fmap: FqnMap, check_shapes: Any
) -> dict[str, Any]:
    """``sd`` (a torch ``Optimizer.state_dict()``) matched by position onto ``leaves``' groups and
    rewritten as the packed dict of the same groups and state keyed by FQN; refused
    (`CheckpointMismatchError`) where groups, group sizes, ids or state shapes disagree.
    ``check_shapes(leaf, fqn, param, state)`` raises on a state tensor that does not fit ``param``."""
    groups, state = sd[NESTED_KEYS[1]], sd[NESTED_KEYS[0]]
    saved_params = [list(g.get(PARAMS, ())) if isinstance(g, Mapping) else [] for g in groups]
    targets = [(leaf, opt, gi, g) for leaf, opt in leaves for gi, g in enumerate(opt.param_groups)]
    target_sizes = [g[PARAMS] for _leaf, _opt, _gi, g in targets]
    if list(map(len, saved_params)) != list(map(len, target_sizes)):
        raise _refuse(
            f"its {len(saved_params)} param group(s) hold {_shape_text(saved_params)} parameters, the target's "
            f"{len(targets)} group(s) {_shape_text(target_sizes)}",
            saved_params,
        )
    fqn_of: dict[int, tuple[str, str, torch.Tensor]] = {}  # saved id -> (leaf, FQN, target parameter)
    per_leaf: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {leaf: ([], {}) for leaf, _ in leaves}
    for (leaf, _opt, gi, group), saved, ids in zip(targets, groups, saved_params):
        fqns = []
        for i, (sid, p) in enumerate(zip(ids, group[PARAMS])):
            if type(sid) is not int:
                raise _refuse(f"group {gi}'s parameter {i} is {sid!r}, not an int id", saved_params)
            fqn = fmap.fqn_of.get(id(p))
            if fqn is None:
                raise CheckpointMismatchError(
                    f"leaf {leaf!r} group {gi}: parameter {i} (shape {tuple(p.shape)}) is not a parameter of the model"
                )
            if fqn_of.setdefault(sid, (leaf, fqn, p))[1] != fqn:
                raise _refuse(f"id {sid} is listed for two parameters", saved_params)
            fqns.append(fqn)
        settings = {k: v for k, v in saved.items() if k != PARAMS}
        per_leaf[leaf][0].append({**settings, PARAMS: fqns})
    for key, value in state.items():
        sid = _saved_id(key)
        found = fqn_of.get(sid) if sid is not None else None
        if found is None:
            raise _refuse(f"state entry {key!r} belongs to no id of its param groups", saved_params)
        leaf, fqn, p = found
        if check_shapes is not None:
            try:
                check_shapes(leaf, fqn, p, value)
            except CheckpointMismatchError as exc:
                raise _refuse(
                    f"the state of id {key!r} does not fit parameter {fqn!r} at its position ({exc})", saved_params
                ) from None
        per_leaf[leaf][1][fqn] = value
    out: dict[str, Any] = {}
    for leaf, (leaf_groups, leaf_state) in per_leaf.items():
        out.update(nested_to_sparse({NESTED_KEYS[0]: leaf_state, NESTED_KEYS[1]: leaf_groups}, leaf=leaf))
    warnings.warn(
        f"sparse_ckpt: loaded a torch optimizer.state_dict() (int ids) by position: {len(groups)} group(s) of "
        f"{_shape_text(saved_params)} parameters, state of {len(state)}",
        PositionalLoadWarning,
        stacklevel=5,
    )
    return out
