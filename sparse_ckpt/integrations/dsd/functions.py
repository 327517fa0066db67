"""torch DSD's four optimizer-facing functions, sparse and exact, with DSD's signatures and layouts.

``get_optimizer_state_dict`` / ``get_state_dict`` return DSD's nested or flat layout
(``StateDictOptions.flatten_optimizer_state_dict``) built from what the optimizers hold: no
synthetic step (nothing is written into the live optimizer or its parameters' ``.grad``), every
group's settings (also of groups whose parameters have no state), only the state that exists.
``full_state_dict`` and ``cpu_offload`` are DSD's own post-processing. The dict is a
`sparse_ckpt.integrations.dsd.target.DsdStateDict`, so a ``dcp.load`` into it reads what the
checkpoint has (see `sparse_ckpt.integrations.dsd.target`).

``set_optimizer_state_dict`` / ``set_state_dict`` load a DSD dict (nested or flat, from DSD or from
here, or a sparse_ckpt checkpoint read into a marked dict) with the library's loader: by FQN, every
group's settings, the state that is there and no other, transactional. ``full_state_dict`` dicts
are cut into this rank's shards, ``broadcast_from_rank0`` takes rank 0's dict. ``strict`` (DSD:
the model's ``load_state_dict``) also makes the optimizer load refuse missing FQNs and entries that
match no model parameter; as in DSD, entries of model parameters outside the optimizers passed are
ignored (a dict merged from several optimizers, a rank whose optimizer lacks its empty shards'
parameters; in DSD's nested layout each rank matches its groups by their members, as DSD does). In a
process group of several ranks the ranks agree on a refusal before anything is changed: one rank's
refusal raises on every rank, naming it; a rank waits at most ``SPARSE_CKPT_AGREEMENT_WAIT_S``
seconds (30) for the others to get there, then refuses alone (`sparse_ckpt._dist.agree_on_refusal`).

The model side of ``get_state_dict``/``set_state_dict`` is torch's own ``get_model_state_dict`` /
``set_model_state_dict``. What this module cannot serve exactly goes to torch's DSD unchanged (so
``install()`` never breaks a call that worked): models with FSDP1 (``FullyShardedDataParallel``,
flat parameters), the deprecated ``submodules`` argument, models using DSD's ``_fqn_modifiers``
hook, optimizers the library cannot capture (a class that overrides ``state_dict`` without a
registered adapter, see `sparse_ckpt.register_state_dict_adapter`), and calls whose optimizers or
dict hold values the library's formats cannot hold as they are (`values_held`), one warning each.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as _dsd
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from ..._dcp.stateful import SparseOptimizerState, planned_load
from ..._dist import agree_on_refusal, agreement_wait_s, multi_rank, world_and_rank
from ..._format.codec import encode_settings
from ..._format.keys import STATE_PREFIX
from ..._fqn import build_fqn_map
from ..._gc import gc_paused
from ..._leaves import named_leaves
from ..._load.load import load_owned
from ..._save.capture import check_leaves
from ..._save.state_values import values_load_back
from ...errors import CheckpointFormatError, SparseCheckpointError, UnsupportedStateDictError
from .._rebind import pristine
from . import full, layouts
from .target import DsdStateDict, remember_stateless

__all__ = [
    "ROUTED",
    "get_optimizer_state_dict",
    "get_state_dict",
    "served",
    "set_optimizer_state_dict",
    "set_state_dict",
    "torch_dsd",
]

ROUTED = ("get_optimizer_state_dict", "set_optimizer_state_dict", "get_state_dict", "set_state_dict")
"""DSD's functions that ``install()`` routes here (`sparse_ckpt.integrations.dsd.patching`)."""

torch_dsd: dict[str, Any] = {
    name: pristine(getattr(_dsd, name)) if name in ROUTED else getattr(_dsd, name)
    for name in (*ROUTED, "get_model_state_dict", "set_model_state_dict")
}
"""What runs torch's own DSD: for the `ROUTED` functions, clones that run torch's original code
(`sparse_ckpt.integrations._rebind.pristine`: ``install()`` swaps the code of torch's function
objects themselves, so calling those would come back here); torch's objects for the others."""


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """DSD's ``get_optimizer_state_dict``, exact and sparse (see the module doc)."""
    optims = _as_tuple(optimizers)
    opts = _checked(options, optims)
    if not served(model, optims, submodules, opts):
        return torch_dsd["get_optimizer_state_dict"](model, optimizers, submodules=submodules, options=options)
    return _served_or_stock(
        lambda: _optimizer_state_dict(model, optims, opts),
        lambda: values_held(optims),
        lambda: torch_dsd["get_optimizer_state_dict"](model, optimizers, submodules=submodules, options=options),
    )


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """DSD's ``get_state_dict``: torch's model state dict and the exact, sparse optimizer dict."""
    optims = _as_tuple(optimizers)
    opts = _checked(options, optims)
    if not served(model, optims, submodules, opts):
        return torch_dsd["get_state_dict"](model, optimizers, submodules=submodules, options=options)

    def served_call() -> tuple[dict[str, Any], dict[str, Any]]:
        optim_sd = _optimizer_state_dict(model, optims, opts)
        return torch_dsd["get_model_state_dict"](model, options=options), optim_sd

    return _served_or_stock(
        served_call,
        lambda: values_held(optims),
        lambda: torch_dsd["get_state_dict"](model, optimizers, submodules=submodules, options=options),
    )


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """DSD's ``set_optimizer_state_dict``, exact (see the module doc): nothing is invented."""
    optims = _as_tuple(optimizers)
    opts = _checked(options, optims)
    if not served(model, optims, None, opts):
        return torch_dsd["set_optimizer_state_dict"](model, optimizers, optim_state_dict, options=options)
    return _served_or_stock(
        lambda: _load_optimizers(model, optims, optim_state_dict, opts, "set_optimizer_state_dict"),
        lambda: dict_values_held(optim_state_dict),
        lambda: torch_dsd["set_optimizer_state_dict"](model, optimizers, optim_state_dict, options=options),
    )


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> Any:
    """DSD's ``set_state_dict``: the optimizers exactly (first, as DSD), then torch's model load;
    returns the model load's ``missing_keys``/``unexpected_keys``."""
    optims = _as_tuple(optimizers)
    opts = _checked(options, optims, optim_only=False)
    if not served(model, optims, None, opts):
        return torch_dsd["set_state_dict"](
            model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=options
        )
    if not (optim_state_dict or opts.broadcast_from_rank0):  # (other ranks pass {} and receive rank 0's)
        return torch_dsd["set_model_state_dict"](model, model_state_dict, options=options)

    def served_call() -> Any:
        _load_optimizers(model, optims, optim_state_dict, opts, "set_state_dict")
        return torch_dsd["set_model_state_dict"](model, model_state_dict, options=options)

    return _served_or_stock(
        served_call,
        lambda: dict_values_held(optim_state_dict),
        lambda: torch_dsd["set_state_dict"](
            model, optimizers, model_state_dict=model_state_dict, optim_state_dict=optim_state_dict, options=options
        ),
    )


def served(model: nn.Module, optims: tuple[Any, ...], submodules: Any, options: StateDictOptions) -> bool:
    """Whether this module serves the call exactly; else it goes to torch's DSD (see the module doc)."""
    if submodules:
        return False
    try:
        check_leaves(layouts.leaves_of(optims))
    except (UnsupportedStateDictError, TypeError):
        return False
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if FSDP.fsdp_modules(model):
        return False
    hook = getattr(options, "dsd_fqn_modifiers", "_fqn_modifiers")
    return not any(callable(getattr(m, hook, None)) for m in model.modules())


def values_held(optims: tuple[Any, ...]) -> bool:
    """Whether sparse_ckpt's formats hold every value of ``optims``: each group's settings encode in the
    table codec (docs/formats.md, *Table codec*: exact types, ints of 64 bits, valid Unicode) and each
    state value is one a load gives back with its type (`sparse_ckpt._save.state_values`). A
    ``numpy.float64`` lr or step, an ``Enum`` member, a ``Decimal``, a ``namedtuple``, an int beyond 64
    bits or a str with a lone surrogate is not: stock DSD pickles such values, so a call that holds
    them goes to torch's DSD (see the module doc) instead of failing where stock works."""
    return all(
        _settings_held(leaf, gi, group)
        for leaf, opt in named_leaves(layouts.leaves_of(optims))
        for gi, group in enumerate(opt.param_groups)
    ) and all(
        values_load_back(state.values())
        for _leaf, opt in named_leaves(layouts.leaves_of(optims))
        for state in opt.state.values()
        if isinstance(state, Mapping)
    )


def dict_values_held(sd: Mapping[str, Any]) -> bool:
    """`values_held` for the values of a DSD dict, nested (``state``: ``{fqn: {key: value}}``,
    ``param_groups``: a list of dicts) or flat (``state.{fqn}.{key}`` and ``param_groups.{fqn}.{key}``
    entries)."""
    groups = sd.get(layouts.PARAM_GROUPS)
    if isinstance(groups, list):
        state = sd.get(layouts.STATE)
        states = state.values() if isinstance(state, Mapping) else ()
        return all(_settings_held("optim", gi, g) for gi, g in enumerate(groups) if isinstance(g, Mapping)) and all(
            values_load_back(s.values()) for s in states if isinstance(s, Mapping)
        )
    return all(
        _settings_held("optim", 0, {k: v}) if k.startswith("param_groups.") else values_load_back((v,))
        for k, v in sd.items()
        if isinstance(k, str) and k.startswith(("param_groups.", STATE_PREFIX))
    )


def _settings_held(leaf: str, group_index: int, group: Mapping[str, Any]) -> bool:
    """Whether the table codec encodes a group's settings (its ``params`` aside): the codec's own rules."""
    try:
        encode_settings(leaf, group_index, {k: v for k, v in group.items() if k != layouts.PARAMS})
    except CheckpointFormatError:
        return False
    return True


def _served_or_stock(run: Callable[[], Any], held: Callable[[], bool], stock: Callable[[], Any]) -> Any:
    """``run()`` (this module's exact call); when it raises `CheckpointFormatError` and ``held()`` says
    that a value of the optimizers (or of the dict loaded) is one sparse_ckpt's formats do not hold,
    ``stock()`` (torch's DSD, one warning) instead: a call that works with stock DSD keeps working.
    A load is transactional, so a refused one changed nothing before ``stock()`` runs."""
    try:
        return run()
    except CheckpointFormatError:
        if held():
            raise
    warnings.warn(
        "sparse_ckpt.integrations.dsd: a param-group setting or a state value of this optimizer has a type or "
        "value sparse_ckpt's formats cannot give back as it is (e.g. a numpy.float64 lr or step, an Enum "
        "member, an int beyond 64 bits); this call goes to torch's DSD (synthetic step included). Store plain "
        "values (float(lr), member.value, a tensor) for an exact, sparse checkpoint",
        stacklevel=3,
    )
    return stock()


# --------------------------------------------------------------------------- internals


def _as_tuple(optimizers: Any) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


def _checked(options: StateDictOptions | None, optims: tuple[Any, ...], optim_only: bool = True) -> StateDictOptions:
    """DSD's option checks (same messages): at least one optimizer, broadcast only with full dicts."""
    if optim_only and not optims:
        raise RuntimeError("Optimizers are not passed in but optim_only is set to True.")
    opts = options or StateDictOptions()
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise ValueError("full_state_dict must be True when broadcast_from_rank0 is True.")
    return opts


def _optimizer_state_dict(model: nn.Module, optims: tuple[Any, ...], opts: StateDictOptions) -> DsdStateDict:
    leaves = layouts.leaves_of(optims)
    owner = SparseOptimizerState(model, leaves, format="flat", strict=opts.strict)
    with gc_paused():
        if opts.flatten_optimizer_state_dict:
            sd = layouts.flat_state_dict(model, leaves)
        else:
            sd = layouts.nested_state_dict(build_fqn_map(model), leaves)
    out = DsdStateDict(full.full_or_cpu(sd, opts.full_state_dict, opts.cpu_offload), owner)
    remember_stateless(out, _owner_maker(model, optims, opts.strict))
    return out


def _owner_maker(model: nn.Module, optims: tuple[Any, ...], strict: bool) -> Callable[[], SparseOptimizerState | None]:
    """Makes ``_optimizer_state_dict``'s owner again, while the model and optimizers are alive."""
    refs = (weakref.ref(model), *(weakref.ref(o) for o in optims))

    def make() -> SparseOptimizerState | None:
        objects = [r() for r in refs]
        if any(o is None for o in objects):
            return None
        return SparseOptimizerState(objects[0], layouts.leaves_of(tuple(objects[1:])), format="flat", strict=strict)

    return make


def _load_optimizers(
    model: nn.Module, optims: tuple[Any, ...], osd: Mapping[str, Any], opts: StateDictOptions, what: str
) -> None:
    """Load ``osd`` into ``optims`` with DSD's rule for extra entries (those of model parameters
    outside ``optims`` are ignored). In a process group of several ranks every rank loads at once, so
    the ranks agree on a refusal before anything is mutated (``what``: the call, for its message)."""
    agree = what if multi_rank() else None
    within = agreement_wait_s() if agree is not None else None  # stock DSD waits on no rank: a bounded wait
    leaves = layouts.leaves_of(optims)
    if opts.broadcast_from_rank0 and multi_rank():
        data, refusal = {}, None
        if world_and_rank()[1] == 0:
            try:
                data = layouts.loadable(layouts.matched_by_members(osd, leaves, build_fqn_map(model)))
            except SparseCheckpointError as exc:  # raised on every rank by the broadcast
                refusal = exc
        data = full.broadcast_from_rank0(data, _broadcast_device(model), refusal)
    else:
        data = None
    try:
        unresolved: dict[str, Any] = {}
        planned = planned_load(
            osd, unresolved, model
        )  # a DsdStateDict the planner rebuilt: as SparseOptimizerState's load
        if planned.get("fmap") is None:
            planned["fmap"] = build_fqn_map(model)
        if data is None:
            data = layouts.loadable(layouts.matched_by_members(osd, leaves, planned["fmap"]))
        data.update(unresolved)
        if opts.full_state_dict:
            data = full.shard_like_params(data, planned["fmap"])
    except Exception as exc:
        if agree is not None:
            agree_on_refusal(exc, agree, within=within)
        raise
    load_owned(
        model,
        leaves,
        data,
        strict=opts.strict,
        unowned_are_other_ranks=multi_rank(),
        unoptimized_ignored=True,
        agree=agree,
        agree_within=within,
        **planned,
    )


def _broadcast_device(model: nn.Module) -> torch.device:
    """Where ``broadcast_from_rank0`` tensors travel: CPU on Gloo, else the parameters' device."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")  # pragma: no cover - a model without parameters
