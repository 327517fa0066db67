"""Python twins of ``csrc/save_pass.cpp``: the save-time pass from a live optimizer leaf to
``(groups_fqn, state_fqn)`` and the ownership check (part of :mod:`sparse_ckpt._core_py`)."""

from __future__ import annotations

from typing import Any

from .errors import CheckpointMismatchError, UnsupportedStateDictError


def capture_fqns(
    leaf: str, param_groups: list[dict], state: dict, fqn_of: dict[int, str], tensor_type: type
) -> tuple[list[tuple[dict, list[str]]], dict[str, Any]]:
    """``(groups_fqn, state_fqn)`` of a live optimizer leaf in one pass: what
    ``remap_to_fqns(leaf, *pack_optimizer(leaf, param_groups, state, tensor_type), fqn_of)``
    gives when no ``state_dict`` post-hook runs (settings are each group without ``"params"``;
    state keeps ``optimizer.state``'s order and its per-parameter values, uncopied).

    Groups whose keys and values are the same objects in the same order (torch shares each
    default value among the groups that did not set it) share one settings dict, so the encoder
    encodes it once; the settings are read-only to every caller.

    Errors, in this order: a state tensor in no group (:class:`UnsupportedStateDictError`), a
    group parameter the model does not own (:class:`CheckpointMismatchError`), a state key that
    is not a tensor (:class:`UnsupportedStateDictError`).
    """
    in_groups: set[int] = set()
    groups_fqn: list[tuple[dict, list[str]]] = []
    unowned: tuple[int, Any] | None = None
    shared: dict[tuple[int, ...], dict] = {}  # the identities of a group's keys and values -> its settings
    for gi, group in enumerate(param_groups):
        ident = tuple(id(x) for kv in dict.items(group) if kv[0] != "params" for x in kv)
        settings = shared.get(ident)
        if settings is None:
            settings = shared[ident] = {k: v for k, v in dict.items(group) if k != "params"}
        fqns: list[str] = []
        for p in group["params"]:
            in_groups.add(id(p))
            fqn = fqn_of.get(id(p))
            if fqn is None:
                if unowned is None:
                    unowned = (gi, p)
                continue
            fqns.append(fqn)
        groups_fqn.append((settings, fqns))
    odd_key: list[Any] = []
    for key in state:
        if isinstance(key, tensor_type):
            if id(key) not in in_groups:
                raise UnsupportedStateDictError(
                    f"leaf {leaf!r}: optimizer.state holds a tensor of shape {tuple(key.shape)} "
                    "that is in no param group"
                )
        elif not odd_key:
            odd_key.append(key)
    if unowned is not None:
        gi, p = unowned
        raise CheckpointMismatchError(
            f"leaf {leaf!r}: group {gi}: optimizer parameter of shape {tuple(p.shape)} is not owned by the model"
        )
    if odd_key:
        raise UnsupportedStateDictError(
            f"leaf {leaf!r}: optimizer.state has a non-parameter key {odd_key[0]!r}, which has no FQN"
        )
    state_fqn = {fqn_of[id(key)]: value for key, value in state.items()}
    return groups_fqn, state_fqn


def claim_owners(leaf: str, groups_fqn: list[tuple[dict, list[str]]], owner: dict[str, str]) -> list[tuple[str, int]]:
    """Record ``leaf`` as the owner of every FQN of its groups (``owner.setdefault``).

    An FQN another leaf owns raises :class:`CheckpointMismatchError` naming both leaves. Returns
    ``(fqn, group index)`` for every listing of an FQN this leaf already listed (a parameter in
    two groups, or twice in one), in order; the caller checks those groups agree.
    """
    repeats: list[tuple[str, int]] = []
    for gi, (_settings, fqns) in enumerate(groups_fqn):
        for fqn in fqns:
            size = len(owner)
            prev = owner.setdefault(fqn, leaf)
            if len(owner) != size:
                continue
            if prev != leaf:
                raise CheckpointMismatchError(f"parameter {fqn!r} is in both leaf {prev!r} and leaf {leaf!r}")
            repeats.append((fqn, gi))
    return repeats
