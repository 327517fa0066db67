"""Python twins of ``csrc/load_assembly.cpp``: one pass per leaf from a decoded checkpoint to the
objects ``Optimizer.__setstate__`` takes (part of :mod:`sparse_ckpt._core_py`).

Input contract (narrow on purpose; :mod:`sparse_ckpt._load.load` passes only these): ``param_groups``
is an optimizer's ``param_groups`` (a list of dicts, each with a ``"params"`` list);
``fqn_of``/``settings_of``/``state_of`` are plain dicts; state values are plain dicts.
Anything outside the fast paths is handed to the callbacks the caller passes, so both twins
make the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._format.keys import STEP_KEY, state_key
from .._immutable import is_immutable
from .errors import CheckpointFormatError, CheckpointMismatchError


def fqns_of_groups(leaf: str, param_groups: list[dict], fqn_of: dict[int, str]) -> list[list[str]]:
    """The canonical FQN of every parameter of every group, in group order.

    A parameter the model does not own raises :class:`CheckpointMismatchError` naming the leaf,
    the group and the parameter's shape.
    """
    out: list[list[str]] = []
    for gi, group in enumerate(param_groups):
        fqns: list[str] = []
        for p in group["params"]:
            fqn = fqn_of.get(id(p))
            if fqn is None:
                raise CheckpointMismatchError(
                    f"leaf {leaf!r} group {gi}: optimizer parameter of shape {tuple(p.shape)} is not owned by the model"
                )
            fqns.append(fqn)
        out.append(fqns)
    return out


def _flat_immutable(settings: dict) -> bool:
    return all(is_immutable(v) for v in settings.values())


def build_groups(
    param_groups: list[dict], chosen: list[dict | None], copy_settings: Callable[[Any], Any], keep_names: bool
) -> list[dict]:
    """The new param groups (what torch's ``load_state_dict`` builds), one new dict per group.

    ``chosen[g]`` is the (interned) saved settings of group ``g``, or ``None`` to keep the
    group's own settings. Settings whose values are all immutable scalars (or tuples of them)
    are copied with ``dict(...)``; any other is copied by ``copy_settings`` (a deep copy), so no
    two groups share a mutable value. ``"params"`` is the live group's list, and the group's
    ``"param_names"`` is kept when the saved settings have none (both as torch does).
    """
    flat_ok: dict[int, bool] = {}
    out: list[dict] = []
    for group, settings in zip(param_groups, chosen):
        if settings is None:
            new = copy_settings({k: v for k, v in dict.items(group) if k != "params"})
        else:
            flat = flat_ok.get(id(settings))
            if flat is None:
                flat = flat_ok[id(settings)] = _flat_immutable(settings)
            new = dict(settings) if flat else copy_settings(settings)
        new["params"] = group["params"]
        if keep_names and "param_names" in group and "param_names" not in new:
            new["param_names"] = group["param_names"]
        out.append(new)
    return out


def _shapes_plain(p: Any, state: Any, tensor_type: type) -> bool:
    """True when every state tensor other than ``step`` has the param's shape and dtype (the
    common case, which needs no further check)."""
    if type(state) is not dict:
        return False
    shape = dtype = None
    for k, v in state.items():
        if isinstance(v, tensor_type):
            if k == STEP_KEY:
                continue
            if shape is None:
                shape, dtype = p.shape, p.dtype
            if v.dtype is not dtype or v.shape != shape:
                return False
        elif type(v) is dict:
            return False
    return True


def cast_states(
    leaf: str,
    param_groups: list[dict],
    target: list[list[str]],
    chosen: list[dict | None],
    state_of: dict[str, Any],
    state: dict,
    tensor_type: type,
    check_shapes: Callable[[str, str, Any, Any], None] | None,
    cast_tensor: Callable[[Any, Any, bool, bool, Any, Any], Any],
    cast_value: Callable[[Any, Any, bool, Any], Any],
) -> list[str]:
    """Put each target parameter's saved state, cast as torch would, into ``state`` (keyed by
    the parameter), in ``state_of``'s order (torch keeps the saved dict's order); return the
    FQNs whose state was used, in that order.

    A parameter listed in several groups takes the fused/capturable flag of the first new group
    listing it (torch's rule); a new group's flags are its ``chosen`` settings' (those of
    :func:`build_groups`), or the group's own when ``chosen`` is ``None``.
    ``check_shapes(leaf, fqn, param, saved)`` (``None``: no check) runs
    for every used state that is not plainly the param's shape and dtype. Tensors are cast by
    ``cast_tensor(value, key, special, floating, dtype, device)`` unless the cast would return the
    tensor itself (non-``step`` with the param's dtype -- for a floating param -- and device;
    ``step`` outside fused/capturable groups); a non-dict state or a non-tensor value goes to
    ``cast_value(param, value, special, key)``.
    """
    where: dict[str, Any] = {}  # fqn -> the param of the first group listing it
    special_fqns: set[str] = set()  # ... when that group is fused or capturable
    special_of: dict[int, bool] = {}  # id(chosen settings) -> its flag
    for group, fqns, settings in zip(param_groups, target, chosen):
        if settings is None:  # the group keeps its own settings
            special = _fused_or_capturable(group)
        else:
            special = special_of.get(id(settings))
            if special is None:
                special = special_of[id(settings)] = _fused_or_capturable(settings)
        for p, fqn in zip(group["params"], fqns):
            if fqn not in where:
                where[fqn] = p
                if special:
                    special_fqns.add(fqn)
    used: list[str] = []
    for fqn, saved in state_of.items():
        p = where.get(fqn)
        if p is None or saved is None:
            continue
        special = fqn in special_fqns
        used.append(fqn)
        if check_shapes is not None and not _shapes_plain(p, saved, tensor_type):
            check_shapes(leaf, fqn, p, saved)
        if type(saved) is not dict:
            state[p] = cast_value(p, saved, special, None)
            continue
        floating = p.is_floating_point()
        dtype, device = p.dtype, p.device
        out: dict = {}
        for k, v in dict.items(saved):
            if isinstance(v, tensor_type):
                if k == STEP_KEY:
                    out[k] = cast_tensor(v, k, special, floating, dtype, device) if special else v
                elif (not floating or v.dtype is dtype) and v.device == device:
                    out[k] = v
                else:
                    out[k] = cast_tensor(v, k, special, floating, dtype, device)
            else:
                out[k] = cast_value(p, v, special, k)
        state[p] = out
    return used


def _fused_or_capturable(settings: dict) -> bool:
    return bool(settings.get("fused", False) or settings.get("capturable", False))


def merge_table_settings(
    leaf: str,
    settings: list[dict],
    groups: list[tuple[int, list[str]]],
    canonical: dict[str, str],
    settings_of: dict[str, dict],
) -> tuple[list[int], tuple[str, int] | None]:
    """Record one decoded table's settings by canonical FQN: ``(empty, clash)``.

    ``groups`` is :func:`decode_table`'s ``(settings index, fqns)`` list and ``settings`` the
    (interned) settings objects by settings index. Each FQN resolves through ``canonical``
    (aliases) and takes ``settings_of[canon]`` unless already set. ``empty``: the indices of the
    groups without parameters. ``clash``: ``(canon, group index)`` of the first FQN that already
    has another settings object (the caller raises, naming both sources); the pass stops there.
    """
    empty: list[int] = []
    for gi, (idx, fqns) in enumerate(groups):
        if not fqns:
            empty.append(gi)
            continue
        s = settings[idx]
        for fqn in fqns:
            canon = canonical.get(fqn, fqn)
            if settings_of.setdefault(canon, s) is not s:
                return empty, (canon, gi)
    return empty, None


def _scalar_entry(fqn: Any, entry: Any) -> tuple[dict[str, Any], Any]:
    """A ``scalars_of`` value of :func:`merge_scalars`: an exact ``(dict, leaf)`` tuple."""
    if type(entry) is not tuple or len(entry) != 2 or type(entry[0]) is not dict:
        raise TypeError(f"merge_scalars: scalars_of[{fqn!r}] must be a (dict, leaf) tuple, got {type(entry).__name__}")
    return entry


def merge_scalars(
    state_of: dict[str, dict], scalars_of: dict[str, tuple[dict[str, Any], str]], tensor_type: type
) -> dict[str, dict]:
    """Each FQN's state: its scalars first, then its per-item entries, in a new dict.

    ``state_of`` is ``FQN -> per-item state`` (an exact dict of exact dicts, as ``unflatten``
    builds it); ``scalars_of`` is an exact dict ``FQN -> (scalars, leaf)`` (exact tuples of an
    exact dict and the leaf name) as ``decode_state.decode_scalar_tables`` returns it; one scalar dict
    may be shared by many FQNs. Other types raise :class:`TypeError` naming the argument. FQNs
    keep ``state_of``'s order (those without scalars keep their state object); FQNs with scalars
    only follow in ``scalars_of``'s order (an empty scalar dict gives them no entry).

    Every FQN with scalars gets a dict of its own, and its own tensors: the first FQN (in that
    order) to take a shared scalar dict gets its values, every later one ``value.clone()`` of
    each ``tensor_type`` value (an optimizer steps ``step`` in place). A scalar key that is also
    a per-item key of the FQN raises :class:`CheckpointFormatError` naming the first such key
    (in the per-item state's order).
    """
    if type(state_of) is not dict:
        raise TypeError(f"merge_scalars: state_of must be a dict, got {type(state_of).__name__}")
    if type(scalars_of) is not dict:
        raise TypeError(f"merge_scalars: scalars_of must be a dict, got {type(scalars_of).__name__}")
    handed: set[int] = set()

    def own(scalars: dict[str, Any]) -> dict[str, Any]:
        if id(scalars) not in handed:
            handed.add(id(scalars))
            return dict(scalars)
        return {k: v.clone() if isinstance(v, tensor_type) else v for k, v in scalars.items()}

    merged: dict[str, dict] = {}
    for fqn, state in state_of.items():
        entry = scalars_of.get(fqn)
        if entry is None:
            merged[fqn] = state
            continue
        scalars, leaf = _scalar_entry(fqn, entry)
        if type(state) is not dict:
            raise TypeError(f"merge_scalars: state_of[{fqn!r}] must be a dict, got {type(state).__name__}")
        for k in state:
            if k in scalars:
                raise CheckpointFormatError(
                    f"leaf {leaf!r}: state key {k!r} of {fqn!r} is both in a scalar table and the per-item entry "
                    f"'{state_key(fqn, k)}' (corrupt or edited checkpoint)"
                )
        new = own(scalars)
        new.update(state)
        merged[fqn] = new
    for fqn, entry in scalars_of.items():
        if fqn not in state_of:
            scalars, _leaf = _scalar_entry(fqn, entry)
            if scalars:
                merged[fqn] = own(scalars)
    return merged


def unlisted_keys(
    keys_of: dict[str, tuple[tuple[str, ...], str]], state_of: dict[str, dict], owned: dict[str, Any]
) -> list[tuple[str, str]]:
    """``(fqn, key)`` of every recorded state key that is not a top-level key of its FQN's state,
    for the FQNs in ``owned`` (in ``keys_of``'s order, then the keys' order).

    ``keys_of`` is ``FQN -> (recorded keys, leaf)`` (exact dict; exact tuples, the keys ``str``),
    ``state_of`` ``FQN -> state dict`` (an FQN without state has none), ``owned`` an exact dict of
    the FQNs to check; other types raise :class:`TypeError` naming the argument. A nested key
    (``"ema.decay"``) or an escaped one (``"~i7"``) is never a top-level key: the caller resolves
    those (the usual state has neither, so the list is usually empty).
    """
    for name, value in (("keys_of", keys_of), ("state_of", state_of), ("owned", owned)):
        if type(value) is not dict:
            raise TypeError(f"unlisted_keys: {name} must be a dict, got {type(value).__name__}")
    out: list[tuple[str, str]] = []
    for fqn, entry in keys_of.items():
        if fqn not in owned:
            continue
        if type(entry) is not tuple or len(entry) != 2 or type(entry[0]) is not tuple:
            raise TypeError(f"unlisted_keys: keys_of[{fqn!r}] must be a (keys, leaf) tuple, got {type(entry).__name__}")
        state = state_of.get(fqn)
        if state is not None and type(state) is not dict:
            raise TypeError(f"unlisted_keys: state_of[{fqn!r}] must be a dict, got {type(state).__name__}")
        for key in entry[0]:
            if state is None or key not in state:
                out.append((fqn, key))
    return out
