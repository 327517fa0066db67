"""Canonical parameter FQNs of a model.

FQNs come from ``model.named_parameters(remove_duplicate=False)`` with the wrapper prefixes
that torch DSD strips removed: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.`` and
activation checkpointing's ``_checkpoint_wrapped_module.``. A tied parameter is saved under its
first FQN; every alias is accepted when loading.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import _backend
from ._torch_compat import named_parameters_canonical

_ALWAYS_STRIPPED = frozenset({"_orig_mod", "_checkpoint_wrapped_module"})


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
        if part in _ALWAYS_STRIPPED:
            continue
        if part == "module" and prefix in ddp_prefixes:
            continue
        kept.append(part)
    return ".".join(kept)


def build_fqn_map(model: nn.Module) -> FqnMap:
    """Walk ``model`` once and build its :class:`FqnMap`."""
    fmap = FqnMap()
    named = named_parameters_canonical(model, _ALWAYS_STRIPPED, _ddp_type())
    if named is None:
        ddp = _ddp_prefixes(model)
        named = (
            # canonical_name only strips _ALWAYS_STRIPPED parts (and DDP `module.`): skip it for other names
            (raw, canonical_name(raw, ddp) if ddp or any(s in raw for s in _ALWAYS_STRIPPED) else raw, param)
            for raw, param in model.named_parameters(remove_duplicate=False)
        )
    fmap.fqn_of, fmap.canonical, fmap.param_of = _backend.core.fqn_tables(named)
    return fmap


def _ddp_type() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DistributedDataParallel
