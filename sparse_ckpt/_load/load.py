"""``load_sparse_state_dict``: restore groups and existing state by FQN.

Everything is validated before anything is mutated; if applying a later leaf fails, the leaves
already applied are rolled back, so on any error every optimizer is as it was.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Collection, Mapping
from itertools import chain
from typing import Any

import torch

from .. import _backend
from .._dcp.origin import strip_origin
from .._dist import agree_on_refusal
from .._format.keys import STATE_PREFIX, STEP_KEY, owner_fqn, split_group_key
from .._fqn import FqnMap, Model, build_fqn_map
from .._gc import gc_paused
from .._layouts.bucketed_load import BucketReader
from .._leaves import named_leaves
from .._text import first_n
from .._torch_internals import load_state_dict_pre_hooks
from ..errors import CheckpointMismatchError, SparseCheckpointError
from .apply import (
    PreparedLoad,
    cast_tensor,
    cast_value,
    commit_prepared,
    copy_settings,
    overrides_load_state_dict,
    prepare_packed,
    rollback,
    run_post_hooks,
    snapshot,
)
from .decode import DecodedCheckpoint, decode_checkpoint
from .positional import is_positional, positional_to_sparse, with_state_entry


def _check_state_shapes(leaf: str, fqn: str, param: torch.Tensor, state: Any, path: str = "") -> None:
    """A saved state tensor with the param's rank must have the param's shape (dims of 1 allowed,
    for Adafactor's factored row/col variance); one of another rank must not have the param's
    number of elements (``(16,)`` or ``(1, 4, 4)`` for a ``(4, 4)`` param: the same values in the
    wrong layout) unless it is 0-d; and it must be complex exactly when the param is."""
    if not isinstance(state, dict):
        return
    pshape = param.shape
    pcomplex = param.is_complex()
    pnumel = param.numel()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            if key == STEP_KEY:
                continue
            vshape = value.shape
            if vshape != pshape and (
                any(s not in (p, 1) for s, p in zip(vshape, pshape))
                if len(vshape) == len(pshape)
                else len(vshape) > 0 and pnumel > 1 and value.numel() == pnumel
            ):
                where = f"{path}{key}"
                raise CheckpointMismatchError(
                    f"leaf {leaf!r}: state {where!r} of {fqn!r} has shape {tuple(vshape)}, "
                    f"the parameter {tuple(pshape)}"
                )
            if value.is_complex() != pcomplex:
                where = f"{path}{key}"
                raise CheckpointMismatchError(
                    f"leaf {leaf!r}: state {where!r} of {fqn!r} has dtype {value.dtype}, "
                    f"incompatible with the parameter's {param.dtype}"
                )
        elif isinstance(value, dict):
            _check_state_shapes(leaf, fqn, param, value, f"{path}{key}.")


_FLAT_STATE_OPTIMIZERS = (torch.optim.LBFGS,)
"""Optimizers whose state tensors are flat vectors over all their parameters (no shape check)."""


def plan_leaf(
    leaf: str,
    optimizer: torch.optim.Optimizer,
    fmap: FqnMap,
    ckpt: DecodedCheckpoint,
    strict: bool,
    missing: list[str],
    used_settings: set[str],
    used_state: set[str],
) -> PreparedLoad | dict[str, Any]:
    """Plan one target leaf (no mutation).

    The common case -- ``Optimizer.load_state_dict`` not overridden, no load pre-hooks, no saved
    ``param_names`` -- is built by the core in one pass straight into what ``__setstate__``
    takes (a `PreparedLoad`), with no int ids in between. Otherwise the torch-format
    packed dict is returned, for `prepare_packed` (which runs the hooks on it)."""
    core = _backend.core
    target = core.fqns_of_groups(leaf, optimizer.param_groups, fmap.fqn_of)
    chosen, leaf_missing = core.match_groups(leaf, target, ckpt.settings_of)
    missing.extend(leaf_missing)
    used_settings.update(chain.from_iterable(target))
    chosen = _with_empty_groups(leaf, target, chosen, ckpt, strict)
    chosen = _check_class_keys(leaf, optimizer, chosen, strict)
    check = None if isinstance(optimizer, _FLAT_STATE_OPTIMIZERS) else _check_state_shapes
    if not ckpt.names_of and not overrides_load_state_dict(optimizer) and not load_state_dict_pre_hooks(optimizer):
        groups = core.build_groups(optimizer.param_groups, chosen, copy_settings, True)
        state: defaultdict[Any, Any] = defaultdict(dict)
        used = core.cast_states(
            leaf,
            optimizer.param_groups,
            target,
            chosen,
            ckpt.state_of,
            state,
            torch.Tensor,
            check,
            cast_tensor,
            cast_value,
        )
        used_state.update(used)
        return PreparedLoad(leaf, optimizer, state=state, param_groups=groups)
    packed_groups, _state, _ids = core.pack_optimizer(leaf, optimizer.param_groups, {}, torch.Tensor)
    # Every group below is a new dict sharing no mutable value with the checkpoint, the optimizer
    # or another group (as torch's deepcopy would give), so apply need not copy them again.
    groups = core.build_groups(optimizer.param_groups, chosen, copy_settings, False)
    for gi, new in enumerate(groups):
        if ckpt.names_of and target[gi] and any(f in ckpt.names_of for f in target[gi]):
            new = groups[gi] = _with_param_names(
                new, optimizer.param_groups[gi], target[gi], ckpt.names_of, ckpt.names_list_of
            )
        new["params"] = packed_groups[gi]["params"]
    packed_state, used = core.assign_state_ids(target, ckpt.state_of)
    used_state.update(used)
    if check is not None:
        for fqn in used:
            check(leaf, fqn, fmap.param_of[fqn], ckpt.state_of[fqn])
    return {"state": packed_state, "param_groups": groups}


NOT_CLASS_KEYS = frozenset(
    {
        "params",
        "param_names",  # the group's parameters, not settings
        "initial_lr",
        "max_lr",
        "min_lr",
        "base_momentum",
        "max_momentum",  # added by LR schedulers
        "decoupled_weight_decay",
        "differentiable",
        "fused",
        "foreach",
        "capturable",
        "maximize",  # added by newer torch
    }
)
"""Group keys that say nothing about the optimizer class: a scheduler adds them, or a newer torch
has them in a class's defaults where an older one did not (its ``__setstate__`` fills them in)."""


def _check_class_keys(leaf: str, optimizer: torch.optim.Optimizer, chosen: list[Any], strict: bool) -> list[Any]:
    """Refuse saved settings written by another optimizer class: keys of a torch optimizer class
    (`torch_class_keys`) that the target class's ``defaults`` lack (and the target group lacks too),
    or ``defaults`` keys the saved settings lack (`NOT_CLASS_KEYS` aside). A key of the user's own
    (a group's ``"name"``) is no class's, so it loads as torch loads it. ``strict=False`` loads
    them, each group keeping its own value of the class's keys the checkpoint lacks. One check per
    distinct settings object."""
    defaults = getattr(optimizer, "defaults", None)
    if not isinstance(defaults, Mapping):
        return chosen
    # each distinct settings object once, at its first group (C-speed: groups may be one per parameter)
    first_of = dict(zip(map(id, reversed(chosen)), range(len(chosen) - 1, -1, -1)))
    first_of.pop(id(None), None)
    class_keys = torch_class_keys()
    misfits: dict[int, list[str]] = {}
    for sid, gi in first_of.items():
        settings, group = chosen[gi], optimizer.param_groups[gi]
        extra = [k for k in settings if k not in defaults and k not in group and k in class_keys]
        lacking = [k for k in defaults if k not in settings and k not in NOT_CLASS_KEYS]
        if extra or lacking:
            if strict:
                raise CheckpointMismatchError(_class_message(leaf, gi, type(optimizer), settings, extra, lacking))
            misfits[sid] = lacking
    if not misfits:
        return chosen
    out = list(chosen)
    for gi, settings in enumerate(chosen):
        lacking = misfits.get(id(settings)) if settings is not None else None
        if lacking is not None:  # strict=False: the group keeps its own value of each key the checkpoint lacks
            group = optimizer.param_groups[gi]
            out[gi] = {**settings, **{k: group[k] for k in lacking if k in group}}
    return out


def _class_message(
    leaf: str, gi: int, cls: type, settings: Mapping[str, Any], extra: list[str], lacking: list[str]
) -> str:
    """Why saved settings belong to another optimizer class, and which classes have their keys."""
    name = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim.") else cls.__qualname__
    parts = []
    if extra:
        parts.append(f"settings {extra} that {cls.__name__}'s defaults lack")
    if lacking:
        parts.append(f"no {lacking}, which {cls.__name__} has")
    keys = {k for k in settings if k not in NOT_CLASS_KEYS}
    like = [c for c in _torch_optimizer_classes() if _class_keys(c) == keys]
    by = f" (the keys of {', '.join(like)})" if like else ""
    return (
        f"leaf {leaf!r} group {gi}: the checkpoint was saved from another optimizer class than {name}: its saved "
        f"group has {' and '.join(parts)}{by}. Load it into an optimizer of the class it was saved from; "
        f"strict=False loads the saved settings anyway, each group keeping its own value of {cls.__name__}'s "
        "settings the checkpoint lacks"
    )


@functools.cache
def torch_class_keys() -> frozenset[str]:
    """Every settings key of a torch.optim optimizer class (`_class_keys`): a saved key outside
    them is the user's own, not a sign of another class."""
    return frozenset().union(*map(_class_keys, _torch_optimizer_classes()))


@functools.cache
def _torch_optimizer_classes() -> list[str]:
    """``torch.optim.X`` for every optimizer class torch.optim exports."""
    return sorted(
        f"torch.optim.{n}"
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    )


def _class_keys(qualified: str) -> set[str]:
    """The settings keys of a torch.optim class: its ``__init__`` parameters but ``params`` and `NOT_CLASS_KEYS`."""
    cls = getattr(torch.optim, qualified.rsplit(".", 1)[1])
    try:
        names = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return set()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n for n, prm in names.items() if n != "self" and prm.kind in kinds} - NOT_CLASS_KEYS


def _with_empty_groups(
    leaf: str, target: list[list[str]], chosen: list[Any], ckpt: DecodedCheckpoint, strict: bool
) -> list[Any]:
    """``chosen`` with each target group that has no parameters given the checkpoint's empty group
    at the same leaf and index (packed format); strict refuses a missing one."""
    if 0 not in map(len, target):  # no empty group (the usual case): no Python loop over the groups
        return chosen
    for gi, fqns in enumerate(target):
        if not fqns:
            settings = ckpt.empty_groups.get((leaf, gi))
            if settings is None and strict and ckpt.has_tables:
                raise CheckpointMismatchError(
                    f"leaf {leaf!r} group {gi}: the target group has no parameters and the checkpoint has "
                    "no empty group at that leaf and index"
                )
            chosen[gi] = settings
    return chosen


def _with_param_names(
    settings: dict[str, Any],
    group: dict[str, Any],
    fqns: list[str],
    names_of: dict[str, str | None],
    names_list_of: dict[str, list],
) -> dict[str, Any]:
    """Put ``param_names`` back (first, where torch's packed groups have it) for a target group
    whose saved groups had names: each FQN's saved name when all are known; else (flat format,
    which keeps a group's whole list but no positions) the saved list when every FQN of the group
    carries the same list of the group's length; else the target's own."""
    saved = [names_of.get(f) for f in fqns]
    if all(isinstance(n, str) for n in saved):
        return {"param_names": saved, **settings}
    lists = [names_list_of.get(f) for f in fqns]
    first = lists[0]
    if (
        first is not None
        and len(first) == len(fqns)
        and all(x == first for x in lists[1:])
        and all(isinstance(n, str) for n in first)
    ):
        return {"param_names": list(first), **settings}
    if "param_names" in group:
        return {"param_names": list(group["param_names"]), **settings}
    return settings


def load_sparse_state_dict(
    model: Model,
    optimizer: Any,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
) -> None:
    """Restore param-group settings and existing state from ``state_dict`` (packed, flat, DSD's
    nested dict, or a torch ``optimizer.state_dict()``).

    Parameters are matched by FQN, so a parameter may sit in another leaf or group than when
    saved. Parameters without saved state get no state (no synthetic step). A torch
    ``optimizer.state_dict()`` (int ids) names no parameter: it is matched by position, as torch's
    ``load_state_dict`` does, where the groups and the state's shapes agree (with a
    `~sparse_ckpt.errors.PositionalLoadWarning`), else refused. ``strict=True`` raises
    `CheckpointMismatchError` on missing or extra FQNs, and on settings of another optimizer class
    (keys of a torch optimizer class that the target class's ``defaults`` lack, or the reverse);
    ``strict=False`` keeps a group's current settings when none of its FQNs is saved, ignores extra
    entries, and loads another class's settings keeping each group's own value of its class's keys
    the checkpoint lacks. In every mode a checkpoint none of whose saved parameters the target
    holds is refused (nothing would be applied). On any error every optimizer is left exactly as it was.
    """
    load_owned(model, optimizer, state_dict, strict=strict, unowned_are_other_ranks=False)


def load_owned(
    model: Model,
    optimizer: Any,
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
    unowned_are_other_ranks: bool,
    fmap: FqnMap | None = None,
    reader: BucketReader | None = None,
    present: Collection[str] | None = None,
    unoptimized_ignored: bool = False,
    agree: str | None = None,
    agree_within: float | None = None,
) -> None:
    """`load_sparse_state_dict` for the library's DCP and export paths.

    ``unowned_are_other_ranks=True`` (multi-rank loads): saved FQNs the model does not own, and
    their state, belong to other ranks and are not "extra"; the model's own parameters must still
    be present. ``fmap``: the model's
    FQN map when the caller built it during the same operation (the DCP planner), else built here.
    ``reader``: reads buffer items a DCP load left to the optimizer (``state_layout="buffers"``).
    ``present``: every optimizer key of the checkpoint (a DCP load reads only some of them), for
    the check of the checkpoint's item records (`sparse_ckpt._load.completeness.check_recorded_items`).
    ``unoptimized_ignored`` (torch DSD's rule, for ``integrations.dsd``): saved entries of model
    parameters that no target optimizer holds are ignored, not "extra" (a dict merged from several
    optimizers, a rank whose optimizer lacks the parameters of its empty shards); entries that
    match no model parameter stay extra. ``agree`` (every rank of the default process group
    loads at once; the name of the call): the ranks agree on a refusal before anything is mutated
    (`sparse_ckpt._dist.agree_on_refusal`, bounded by ``agree_within`` seconds when given), so one
    rank's refusal raises on every rank. A dict that records another rank as its origin is refused
    (docs/semantics.md)."""
    with gc_paused():
        try:
            state_dict = strip_origin(state_dict)
            fmap, prepared, ckpt = _plan(
                model,
                optimizer,
                state_dict,
                strict,
                unowned_are_other_ranks,
                fmap,
                reader,
                present,
                unoptimized_ignored,
            )
        except Exception as exc:
            if agree is None:
                raise
            agree_on_refusal(exc, agree, within=agree_within)
            raise  # (agree_on_refusal raised it already)
        if agree is not None:
            agree_on_refusal(None, agree, within=agree_within)
        _apply(prepared, fmap, ckpt)


def _plan(
    model: Model,
    optimizer: Any,
    state_dict: Mapping[str, Any],
    strict: bool,
    unowned_are_other_ranks: bool,
    fmap: FqnMap | None,
    reader: BucketReader | None,
    present: Collection[str] | None,
    unoptimized_ignored: bool,
) -> tuple[FqnMap, list[PreparedLoad], DecodedCheckpoint]:
    """Decode, match and validate everything (the leaves' load pre-hooks included); nothing is mutated."""
    if fmap is None:
        fmap = build_fqn_map(model)
    leaves = named_leaves(optimizer)
    state_dict = with_state_entry(state_dict)
    if is_positional(state_dict):
        state_dict = positional_to_sparse(state_dict, leaves, fmap, _positional_shape_check(leaves))
    ckpt = decode_checkpoint(state_dict, fmap, reader, present, _leaf_finder(leaves, fmap))
    missing: list[str] = []
    used_settings: set[str] = set()
    used_state: set[str] = set()
    plans = [
        (leaf, opt, plan_leaf(leaf, opt, fmap, ckpt, strict, missing, used_settings, used_state))
        for leaf, opt in leaves
    ]
    _refuse_nothing_matched(ckpt, used_settings, used_state, present)
    if strict:
        owned = fmap.param_of if unowned_are_other_ranks else None
        _raise_on_mismatch(
            ckpt,
            missing,
            used_settings,
            used_state,
            {leaf for leaf, _ in leaves},
            owned,
            fmap.param_of if unoptimized_ignored else None,
        )
    # Every leaf's pre-hooks and validation run before any leaf is changed, and post-hooks only
    # once every leaf is in place, so a failing leaf never follows another leaf's post-hooks.
    prepared = [
        plan if isinstance(plan, PreparedLoad) else prepare_packed(leaf, opt, plan, groups_owned=True)
        for leaf, opt, plan in plans
    ]
    return fmap, prepared, ckpt


def _positional_shape_check(leaves: list[tuple[str, Any]]) -> Any:
    """``check(leaf, fqn, param, state)`` for `positional_to_sparse`: `_check_state_shapes`, but not for
    optimizers whose state is not shaped like the parameters."""
    flat = {leaf for leaf, opt in leaves if isinstance(opt, _FLAT_STATE_OPTIMIZERS)}

    def check(leaf: str, fqn: str, param: torch.Tensor, state: Any) -> None:
        if leaf not in flat:
            _check_state_shapes(leaf, fqn, param, state)

    return check


def _refuse_nothing_matched(
    ckpt: DecodedCheckpoint, used_settings: set[str], used_state: set[str], present: Collection[str] | None
) -> None:
    """In every mode: a checkpoint with saved parameters of which the target optimizers hold none
    (and no state landed) would apply nothing; refuse it, naming both sides' FQNs. ``present`` (a
    DCP load: every optimizer key of the checkpoint) also counts the flat entries the planner did not
    read because the model has no such parameter."""
    if not used_settings or used_state or not ckpt.settings_of.keys().isdisjoint(used_settings):
        return
    theirs = list(ckpt.settings_of or ckpt.state_of)
    if not theirs and present:
        flat = (split_group_key(k) for k in present)
        theirs = sorted({f[0] for f in flat if f is not None})  # `present` may be a set: name them in one order
    if not theirs:
        return
    raise CheckpointMismatchError(
        f"none of the checkpoint's {len(theirs)} saved parameter(s) is a parameter of the target optimizer(s): "
        f"it has {fmt_list(theirs, 3)}, the target {fmt_list(sorted(used_settings), 3)}. It was saved from another "
        "model or under other module names: load it into a model whose parameters have the saved names"
    )


def _apply(prepared: list[PreparedLoad], fmap: FqnMap, ckpt: DecodedCheckpoint) -> None:
    """Install every prepared leaf, then run the post-hooks; on any error the leaves already
    installed are rolled back."""
    applied: list[tuple[torch.optim.Optimizer, tuple[Any, Any]]] = []
    try:
        for item in prepared:
            applied.append((item.optimizer, snapshot(item.optimizer)))
            _commit(item, fmap, ckpt)
        for item in prepared:
            run_post_hooks(item)
    except BaseException:
        for opt, saved in reversed(applied):
            rollback(opt, saved)
        raise


def _leaf_finder(leaves: list[tuple[str, Any]], fmap: FqnMap) -> Any:
    """Canonical FQN -> the name of the target leaf holding it (``None``: none), for messages;
    the map is built on the first call (a load that fails)."""
    found: dict[str, str] = {}

    def leaf_of(canon: str) -> str | None:
        if not found:
            for leaf, opt in reversed(leaves):
                for group in opt.param_groups:
                    for p in group["params"]:
                        fqn = fmap.fqn_of.get(id(p))
                        if fqn is not None:
                            found[fqn] = leaf
        return found.get(canon)

    return leaf_of


def _commit(item: Any, fmap: FqnMap, ckpt: DecodedCheckpoint) -> None:
    """Install one prepared leaf; the class refusing the state becomes a mismatch naming the keys.

    A function of its own: a nested ``try:`` line is covered by neither handler (an interrupt
    there would skip the caller's rollback)."""
    try:
        commit_prepared(item)
    except SparseCheckpointError:
        raise
    except Exception as exc:  # the optimizer class refused the state (its __setstate__)
        if item.packed is not None:
            raise  # the class's own load_state_dict raised: its error is the clearest
        raise CheckpointMismatchError(_misfit_message(item.leaf, item.optimizer, fmap, ckpt, exc)) from exc


def _misfit_message(
    leaf: str, optimizer: torch.optim.Optimizer, fmap: FqnMap, ckpt: DecodedCheckpoint, exc: Exception
) -> str:
    """Why a leaf's optimizer class refused the saved state: which state keys it was given."""
    cls = type(optimizer).__name__
    examples: dict[tuple[str, ...], str] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = fmap.fqn_of.get(id(p))
            state = ckpt.state_of.get(fqn) if fqn is not None else None
            if isinstance(state, dict):
                examples.setdefault(tuple(map(str, state)), fqn)  # type: ignore[arg-type]
    shown = "; ".join(f"{fqn!r} has {list(keys)}" for keys, fqn in list(examples.items())[:3])
    return (
        f"leaf {leaf!r}: the saved state does not fit {cls} ({cls}.__setstate__ raised "
        f"{type(exc).__name__}: {exc}); saved state keys: {shown or 'none'}. Was the checkpoint written by "
        "another optimizer class?"
    )


def _raise_on_mismatch(
    ckpt: DecodedCheckpoint,
    missing: list[str],
    used_settings: set[str],
    used_state: set[str],
    target_leaves: set[str],
    owned: Mapping[str, Any] | None = None,
    unoptimized: Mapping[str, Any] | None = None,
) -> None:
    """Raise on missing/extra FQNs; with ``owned`` given, FQNs outside it (other ranks') are not extra;
    with ``unoptimized`` given (the model's parameters: DSD's rule), FQNs inside it are not extra."""
    if missing:
        raise CheckpointMismatchError(
            f"{len(missing)} optimizer parameter(s) have no saved param-group settings: {fmt_list(missing)}. "
            "The checkpoint was saved without them (another model, or an optimizer over other parameters); "
            "strict=False loads what there is and keeps those groups' current settings"
        )
    extra: list[str] = []
    # set differences first (C speed); the ordered lists only when something is extra. Nothing is
    # missing here, so every FQN of used_settings has saved settings: as many as saved means none
    # is extra, with no difference built (likewise used_state, the saved FQNs whose state a leaf took).
    settings_of, state_of = ckpt.settings_of, ckpt.state_of
    if len(used_settings) != len(settings_of) and settings_of.keys() - used_settings:
        extra = [fqn for fqn in settings_of if fqn not in used_settings]
    if len(used_state) != len(state_of) and state_of.keys() - used_state - settings_of.keys():
        extra += [fqn for fqn in state_of if fqn not in used_state and fqn not in settings_of]
    unmatched = ckpt.unmatched_keys
    if owned is not None:
        extra = [fqn for fqn in extra if fqn in owned]
        unmatched = [k for k in unmatched if _unowned_state_fqn(k, ckpt.settings_of, owned) is None]
    if unoptimized is not None and extra:
        foreign = [fqn for fqn in extra if fqn not in unoptimized]
        if foreign:
            raise CheckpointMismatchError(
                f"{len(foreign)} saved parameter(s) match no parameter of the model: {fmt_list(foreign)} "
                "(entries of the model's other parameters are ignored, as torch DSD ignores them). Was the "
                "checkpoint saved from another model, or with other FQNs? StateDictOptions(strict=False) "
                "ignores them"
            )
        extra = []
    if extra:
        leaves = sorted(set(ckpt.table_leaf_of(extra).values()) - target_leaves)
        where = f" (from table(s) of leaf {fmt_list(leaves)}, which the target lacks)" if leaves else ""
        raise CheckpointMismatchError(
            f"{len(extra)} saved parameter(s) are in no target optimizer group{where}: {fmt_list(extra)}. "
            "Load into all the optimizers the checkpoint was saved from at once (a sparse_ckpt.MultiOptimizer "
            "or a mapping of every leaf), or pass strict=False to ignore them"
        )
    if unmatched:
        raise CheckpointMismatchError(
            f"{len(unmatched)} checkpoint key(s) match no model parameter: {fmt_list(unmatched)}. Was the "
            "checkpoint saved from another model, or with other FQNs? strict=False ignores them"
        )
    for leaf, gi in ckpt.empty_groups:
        if leaf not in target_leaves:
            raise CheckpointMismatchError(
                f"the checkpoint's leaf {leaf!r} has an empty group {gi}, and the target has no leaf {leaf!r}: "
                "load into all the optimizers the checkpoint was saved from at once, or pass strict=False"
            )


def fmt_list(items: list[str], limit: int = 10) -> str:
    """``'a', 'b', ... (+N more)`` -- the first ``limit`` items of a load error and a count of the rest."""
    return first_n(items, limit, show=repr)


def _unowned_state_fqn(key: str, saved_fqns: Mapping[str, Any], owned: Mapping[str, Any]) -> str | None:
    """The saved, not owned FQN that ``state.{fqn}.{...}`` key ``key`` belongs to (longest prefix), else None."""
    if not key.startswith(STATE_PREFIX):
        return None
    fqn = owner_fqn(key[len(STATE_PREFIX) :], saved_fqns)
    return None if fqn is None or fqn in owned else fqn
