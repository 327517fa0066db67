"""Twins of csrc/capture.cpp: ``pack_optimizer`` / ``remap_to_fqns``, torch's id packing of an
optimizer and the id -> FQN remapping."""

from __future__ import annotations

from typing import Any

from .errors import CheckpointFormatError, CheckpointMismatchError, UnsupportedStateDictError


def pack_optimizer(
    leaf: str, param_groups: list[dict], state: dict[Any, Any], tensor_type: type
) -> tuple[list[dict], dict[Any, Any], list[Any]]:
    """Pack ``param_groups``/``state`` exactly as ``torch.optim.Optimizer.state_dict`` does.

    Returns ``(packed_groups, packed_state, id_to_param)``: groups are shallow copies with
    ``"params"`` replaced by int ids (first occurrence of a parameter wins, ids advance by the
    group length as in torch), state keys are remapped to those ids, and ``id_to_param[i]`` is
    the parameter that received id ``i`` (``None`` for an id never assigned).
    """
    mapping: dict[int, int] = {}
    id_to_param: list[Any] = []
    packed_groups: list[dict] = []
    for group in param_groups:
        packed = {k: v for k, v in dict.items(group) if k != "params"}
        params = group["params"]
        start = len(id_to_param)
        for offset, p in enumerate(params):
            if id(p) not in mapping:
                mapping[id(p)] = start + offset
                id_to_param.append(p)
            else:
                id_to_param.append(None)
        packed["params"] = [mapping[id(p)] for p in params]
        packed_groups.append(packed)
    packed_state: dict[Any, Any] = {}
    for key, value in state.items():
        if isinstance(key, tensor_type):
            if id(key) not in mapping:
                raise UnsupportedStateDictError(
                    f"leaf {leaf!r}: optimizer.state holds a tensor of shape {tuple(key.shape)} "
                    "that is in no param group"
                )
            packed_state[mapping[id(key)]] = value
        else:
            packed_state[key] = value
    return packed_groups, packed_state, id_to_param


def remap_to_fqns(
    leaf: str,
    packed_groups: list[dict],
    packed_state: dict[Any, Any],
    id_to_param: list[Any],
    fqn_of: dict[int, str],
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]:
    """Turn a packed (int-id) optimizer dict into ``(groups_fqn, state_fqn)``.

    ``id_to_param`` is the snapshot taken by :func:`pack_optimizer`; ``fqn_of`` maps
    ``id(param)`` to its canonical FQN. State entries keep the packed state's order.
    """
    n_ids = len(id_to_param)

    def fqn_for(pid: Any, where: str) -> str:
        if type(pid) is not int or pid < 0 or pid >= n_ids or id_to_param[pid] is None:
            raise CheckpointFormatError(
                f"leaf {leaf!r}: {where} refers to parameter id {pid!r}, which the optimizer never assigned"
            )
        param = id_to_param[pid]
        fqn = fqn_of.get(id(param))
        if fqn is None:
            raise CheckpointMismatchError(
                f"leaf {leaf!r}: {where}: optimizer parameter of shape {tuple(param.shape)} is not owned by the model"
            )
        return fqn

    groups_fqn: list[tuple[dict, list[str]]] = []
    for gi, group in enumerate(packed_groups):
        if "params" not in group:
            raise CheckpointFormatError(f"leaf {leaf!r}: group {gi} has no 'params' entry")
        settings = {k: v for k, v in dict.items(group) if k != "params"}
        fqns = [fqn_for(pid, f"group {gi}") for pid in group["params"]]
        groups_fqn.append((settings, fqns))
    state_fqn: dict[str, Any] = {}
    for pid, value in packed_state.items():
        if type(pid) is not int:
            raise UnsupportedStateDictError(
                f"leaf {leaf!r}: optimizer.state has a non-parameter key {pid!r}, which has no FQN"
            )
        state_fqn[fqn_for(pid, "state")] = value
    return groups_fqn, state_fqn
