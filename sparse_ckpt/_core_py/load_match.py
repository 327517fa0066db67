"""Twins of csrc/load_match.cpp: ``match_groups`` / ``assign_state_ids``, the FQN-based matching
of saved groups and state on load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import CheckpointMismatchError


def match_groups(leaf: str, target_fqns: list[list[str]], settings_of: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """For each target group pick the saved settings of its FQNs.

    ``settings_of`` maps FQN to an *interned* settings object (equal settings are the same
    object). Returns ``(chosen, missing)``: ``chosen[g]`` is the settings object of group ``g``
    or ``None`` when none of its FQNs is saved; ``missing`` lists FQNs without saved settings in
    group order. Two FQNs of one group with different settings raise
    :class:`CheckpointMismatchError` naming both FQNs and the first differing key.
    """
    chosen: list[Any] = []
    missing: list[str] = []
    for gi, fqns in enumerate(target_fqns):
        pick = None
        pick_fqn = ""
        for fqn in fqns:
            s = settings_of.get(fqn)
            if s is None:
                missing.append(fqn)
            elif pick is None:
                pick, pick_fqn = s, fqn
            elif s is not pick:
                key = _first_differing_key(pick, s)
                raise CheckpointMismatchError(
                    f"leaf {leaf!r} group {gi}: saved settings differ between {pick_fqn!r} and {fqn!r} "
                    f"(key {key!r}); one target group cannot take both"
                )
        chosen.append(pick)
    return chosen, missing


def _first_differing_key(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    for key in a:
        if key not in b:
            return key
        va, vb = a[key], b[key]
        if type(va) is not type(vb):
            return key
        try:
            same = bool(va == vb)
        except Exception:  # noqa: BLE001 - tensors and other values without a scalar truth value
            same = va is vb
        if not same:
            return key
    for key in b:
        if key not in a:
            return key
    return "?"


def assign_state_ids(target_fqns: list[list[str]], state_by_fqn: dict[str, Any]) -> tuple[dict[int, Any], list[str]]:
    """Give saved state to the target's packed ids (torch's id assignment order).

    Returns ``(packed_state, used_fqns)``: ``packed_state`` maps the id of every target
    parameter whose FQN has saved state to that state, in ``state_by_fqn``'s order (the saved
    dict's order, which torch's ``load_state_dict`` keeps); ``used_fqns`` lists those FQNs in the
    same order (so the caller can find saved state that no target parameter took).
    """
    pid_of: dict[str, int] = {}
    pid = 0
    for fqns in target_fqns:
        for fqn in fqns:
            if fqn not in pid_of:
                pid_of[fqn] = pid
            pid += 1
    packed_state: dict[int, Any] = {}
    used: list[str] = []
    for fqn, s in state_by_fqn.items():
        if s is not None and fqn in pid_of:
            packed_state[pid_of[fqn]] = s
            used.append(fqn)
    return packed_state, used
