"""Canonical parameter FQNs of a model.

FQNs come from ``model.named_parameters(remove_duplicate=False)`` with the wrapper prefixes
that torch DSD strips removed: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` and
activation checkpointing's ``_checkpoint_wrapped_module.``. A tied parameter is saved under its
first FQN; every alias is accepted when loading.

The map of a model is kept between calls (weakly: it never keeps the model, a module or a
parameter alive) and reused only after one pass over the live module tree finds every module,
name and parameter to be the same object in the same place as when the map was built; any
difference (a module or parameter added, removed, replaced or renamed, a wrapper added) rebuilds
it. `clear_fqn_cache` drops the kept maps.

A *model* is an ``nn.Module`` or a list/tuple of them: the parts of a pipeline-parallel model
(torchtitan's ``model_parts``). Each part's parameters keep that part's own names (as torchtitan
names them); an FQN that two parts both have is an error, since a checkpoint keyed by FQN could
not tell them apart. A parameter object in two parts is one parameter, saved under its first FQN.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from . import _backend
from ._format.keys import STRIPPED_PARTS, WRAPPER_CHILD
from ._torch_internals import map_parameters


@dataclass
class FqnMap:
    """Identity of every model parameter: ``id(param) -> canonical FQN`` and alias resolution."""

    fqn_of: dict[int, str] = field(default_factory=dict)
    """``id(param)`` -> canonical (first) FQN."""
    canonical: dict[str, str] = field(default_factory=dict)
    """Every FQN and alias -> the canonical FQN of its parameter."""
    param_of: dict[str, torch.Tensor] = field(default_factory=dict)
    """Canonical FQN -> parameter."""

    def resolve(self, fqn: str) -> str:
        """Canonical FQN for ``fqn`` (itself when it is not an alias of a known parameter)."""
        return self.canonical.get(fqn, fqn)


def _ddp_prefixes(model: nn.Module) -> set[str]:
    ddp = _ddp_type()
    if ddp is None:  # pragma: no cover - torch without distributed
        return set()
    return {name for name, mod in model.named_modules(remove_duplicate=False) if isinstance(mod, ddp)}


def canonical_name(name: str, ddp_prefixes: set[str]) -> str:
    """Strip wrapper components from a raw ``named_parameters`` name."""
    parts = name.split(".")
    kept: list[str] = []
    raw_prefix: list[str] = []
    for part in parts:
        prefix = ".".join(raw_prefix)
        raw_prefix.append(part)
        if part in STRIPPED_PARTS:
            continue
        if part == WRAPPER_CHILD and prefix in ddp_prefixes:
            continue
        kept.append(part)
    return ".".join(kept)


_MEMOS: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
"""model -> the core's ``map_parameters`` memo of it (both cores make and read the same memos)."""


Model = Union[nn.Module, Sequence[nn.Module]]
"""What sparse_ckpt accepts as a model: a module, or the list of a pipeline-parallel model's parts."""


def check_model(model: Any) -> None:
    """Raise ``TypeError`` unless ``model`` is an ``nn.Module`` or a non-empty list/tuple of them."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, (list, tuple)):
        if not model:
            raise TypeError("model is an empty list; pass the nn.Module, or the list of its pipeline-parallel parts")
        for i, part in enumerate(model):
            if not isinstance(part, nn.Module):
                raise TypeError(f"model part {i} is a {type(part).__name__}, not an nn.Module")
        return
    raise TypeError(
        f"model must be an nn.Module or a list of nn.Module (pipeline-parallel model parts), got {type(model).__name__}"
    )


def validate_model(model: Any) -> None:
    """`check_model`, and for a list of parts their FQN map (an FQN in two parts fails here, where a
    ``SparseOptimizerState`` or ``MultiOptimizer`` is constructed, not at its first save)."""
    check_model(model)
    if not isinstance(model, nn.Module):
        build_fqn_map(model)


def build_fqn_map(model: Model) -> FqnMap:
    """The `FqnMap` of ``model`` (a module or a list of parts): built by one walk, or the kept map
    of an earlier call when a walk that compares identities finds the modules, names and parameters unchanged."""
    if isinstance(model, nn.Module):
        return _module_fqn_map(model)
    check_model(model)
    if len(model) == 1:
        return _module_fqn_map(model[0])
    return _merge_parts([_module_fqn_map(part) for part in model])


def _merge_parts(maps: list[FqnMap]) -> FqnMap:
    """One map of several parts' maps (the parts' own maps, possibly kept ones, are not changed)."""
    out = FqnMap()
    owner: dict[str, int] = {}
    for i, part in enumerate(maps):
        for name in part.canonical:
            first = owner.setdefault(name, i)
            if first != i:
                raise ValueError(
                    f"parameter FQN {name!r} is in model part {first} and model part {i}; a checkpoint keyed by "
                    "FQN cannot tell them apart (name the parts' parameters uniquely)"
                )
        renamed: dict[str, str] = {}
        for pid, fqn in part.fqn_of.items():
            first_fqn = out.fqn_of.setdefault(pid, fqn)
            if first_fqn != fqn:  # one parameter object in two parts: an alias of its first FQN
                renamed[fqn] = first_fqn
            else:
                out.param_of[fqn] = part.param_of[fqn]
        if renamed:
            out.canonical.update({name: renamed.get(fqn, fqn) for name, fqn in part.canonical.items()})
        else:
            out.canonical.update(part.canonical)
    return out


def _module_fqn_map(model: nn.Module) -> FqnMap:
    cached = _memo_of(model)
    mapped = map_parameters(model, STRIPPED_PARTS, _ddp_type(), cached)
    if mapped is None:  # named_parameters/named_modules overridden: the public API
        _keep(model, None)
        ddp = _ddp_prefixes(model)
        named = [
            # canonical_name only strips STRIPPED_PARTS (and DDP's WRAPPER_CHILD): skip it for other names
            (raw, canonical_name(raw, ddp) if ddp or any(s in raw for s in STRIPPED_PARTS) else raw, param)
            for raw, param in model.named_parameters(remove_duplicate=False)
        ]
        return FqnMap(*_backend.core.fqn_tables(named))
    memo, fqn_of, canonical, param_of = mapped
    if memo is not cached:
        _keep(model, memo)
    return FqnMap(fqn_of, canonical, param_of)


def clear_fqn_cache() -> None:
    """Drop every model's kept FQN map (the next call on a model builds it anew)."""
    _MEMOS.clear()


def _memo_of(model: nn.Module) -> tuple | None:
    try:
        return _MEMOS.get(model)
    except TypeError:  # not hashable or not weakly referable: nothing is kept for it
        return None


def _keep(model: nn.Module, memo: tuple | None) -> None:
    try:
        if memo is None:
            _MEMOS.pop(model, None)
        else:
            _MEMOS[model] = memo
    except TypeError:  # not hashable or not weakly referable
        pass


def _ddp_type() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DistributedDataParallel
