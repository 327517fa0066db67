"""Reading optimizer checkpoints that a trainer's stock checkpointer wrote in the flat FQN layout.

torchtitan's ``OptimizersContainer.state_dict`` writes ``state.{fqn}.{key}`` and
``param_groups.{fqn}.{setting}`` for every parameter (torch DSD's flat layout, which sparse_ckpt
reads as its ``flat`` format). Before it reads an optimizer that has no state yet it runs a
*synthetic step* (zero gradients, lr 0), so a never-stepped optimizer is saved with invented
state: ``step == 1`` and all-zero moments. :func:`drop_synthetic_state` finds and removes such
entries from a loaded flat dict (opt-in: a real first step on a zero gradient looks the same),
:func:`step_one_fqns` finds every parameter whose kept state *may* be such state (its ``step`` is 1:
Adam with ``weight_decay`` folds the weights into the synthetic gradient, so its moments are not
zero), and :class:`MigrationReport` says what was dropped, what was kept that may be synthetic, and
which parameters stay without state.

No trainer package is imported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..keys import STATE_PREFIX, STEP_KEY, is_state_item, owner_fqn, split_group_key

__all__ = [
    "DroppedState", "KeptState", "MigrationReport", "drop_synthetic_state", "flat_fqns", "state_keys_by_fqn",
    "step_one_fqns",
]


@dataclass(frozen=True)
class DroppedState:
    """The state of one parameter dropped as invented by a synthetic step."""

    leaf: str
    """The target optimizer leaf the parameter belongs to (``"optim0"``, ...)."""
    fqn: str
    keys: tuple[str, ...]
    """The checkpoint's state keys that were dropped, e.g. ``("state.aux.weight.step", ...)``."""


@dataclass(frozen=True)
class KeptState:
    """The state of one parameter kept as saved although a synthetic step may have invented it: its
    ``step`` is 1 (its moments are not all zero, or ``drop_synthetic_state`` is off). A resume from
    it is exact only if the parameter really stepped once before the save."""

    leaf: str
    fqn: str
    keys: tuple[str, ...]
    """The checkpoint's state keys that were kept."""


@dataclass(frozen=True)
class MigrationReport:
    """What a migrating load of a stock (flat layout) optimizer checkpoint did on this rank."""

    checkpoint_id: str
    dropped: tuple[DroppedState, ...] = ()
    """Every parameter whose saved state was dropped as synthetic (``drop_synthetic_state=True``)."""
    stateless: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Leaf -> FQNs of this rank's parameters that have no state after the load (never saved, or
    dropped): they get state on their first real step, as in an uninterrupted run."""
    possibly_synthetic: tuple[KeptState, ...] = ()
    """Every parameter of this rank whose saved state was kept with ``step == 1`` (see
    :class:`KeptState`): where a leaf had never stepped when the stock checkpointer saved it, this
    is invented state, and the resume is not exact."""

    @property
    def exact(self) -> bool:
        """Nothing kept that a synthetic step may have invented (parameters without state are exact:
        they get state on their first real step)."""
        return not self.possibly_synthetic

    def summary(self, limit: int = 10) -> list[str]:
        """One line per leaf that lost or lacks state (at most ``limit`` FQNs named per line)."""
        lines = []
        by_leaf: dict[str, list[str]] = {}
        for entry in self.dropped:
            by_leaf.setdefault(entry.leaf, []).append(entry.fqn)
        for leaf, fqns in by_leaf.items():
            lines.append(
                f"{self.checkpoint_id}: leaf {leaf!r}: dropped the synthetic-step state (step == 1, all-zero "
                f"moments) of {len(fqns)} parameter(s): {_names(fqns, limit)}"
            )
        kept: dict[str, list[str]] = {}
        for entry in self.possibly_synthetic:
            kept.setdefault(entry.leaf, []).append(entry.fqn)
        for leaf, fqns in kept.items():
            lines.append(
                f"{self.checkpoint_id}: leaf {leaf!r}: kept the state of {len(fqns)} parameter(s) with step == 1 "
                f"that a synthetic step may have invented (its moments are not all zero, e.g. Adam with "
                f"weight_decay, or drop_synthetic_state is off); the resume is exact only if they really stepped "
                f"once: {_names(fqns, limit)}"
            )
        for leaf, fqns in self.stateless.items():
            if fqns:
                lines.append(f"{self.checkpoint_id}: leaf {leaf!r}: {len(fqns)} parameter(s) have no state: {_names(fqns, limit)}")
        return lines


def _names(fqns: list[str] | tuple[str, ...], limit: int) -> str:
    shown = ", ".join(fqns[:limit])
    return shown + (f" and {len(fqns) - limit} more" if len(fqns) > limit else "")


def flat_fqns(data: Iterable[str]) -> set[str]:
    """The FQNs of a flat optimizer dict: those its ``param_groups.{fqn}.{setting}`` keys name."""
    out = set()
    for key in data:
        split = split_group_key(key)
        if split is not None:
            out.add(split[0])
    return out


def state_keys_by_fqn(data: Iterable[str], fqns: set[str]) -> dict[str, list[str]]:
    """``fqn -> its per-item state keys`` of a flat optimizer dict (each key resolved against ``fqns``,
    the dict's own FQNs; a key that resolves to none of them is left out)."""
    out: dict[str, list[str]] = {}
    for key in data:
        if is_state_item(key):
            fqn = owner_fqn(key[len(STATE_PREFIX) :], fqns)
            if fqn is not None:
                out.setdefault(fqn, []).append(key)
    return out


def drop_synthetic_state(data: MutableMapping[str, Any], by_fqn: Mapping[str, list[str]]) -> list[str]:
    """Remove from ``data`` the state of every parameter that looks invented by a synthetic step:
    its ``step`` is 1 and every other state value is a tensor whose values are all zero on every
    rank (a DTensor's shards are checked where they live; ranks agree through one
    ``all_gather_object`` of the FQNs whose local values are not all zero). Returns the dropped
    FQNs, sorted. Must be called on every rank of the default process group when it has more than one."""
    candidates = [fqn for fqn, keys in by_fqn.items() if _looks_synthetic(fqn, keys, data)]
    nonzero = {fqn for fqn in candidates if _any_nonzero(fqn, by_fqn[fqn], data)}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(nonzero))
        nonzero = {fqn for part in gathered for fqn in part}
    dropped = sorted(fqn for fqn in candidates if fqn not in nonzero)
    for fqn in dropped:
        for key in by_fqn[fqn]:
            del data[key]
    return dropped


def step_one_fqns(data: Mapping[str, Any], by_fqn: Mapping[str, list[str]]) -> list[str]:
    """The FQNs (sorted) whose state in ``data`` has ``step == 1``: what a synthetic step writes, and
    what a real first step writes too (``by_fqn``: :func:`state_keys_by_fqn` of ``data``)."""
    return sorted(fqn for fqn, keys in by_fqn.items() if _step_is_one(data.get(_step_key(fqn)) if _step_key(fqn) in keys else None))


def _step_is_one(step: Any) -> bool:
    if isinstance(step, torch.Tensor):
        return step.numel() == 1 and float(step.item()) == 1.0
    return not isinstance(step, bool) and isinstance(step, (int, float)) and step == 1


def _step_key(fqn: str) -> str:
    return f"{STATE_PREFIX}{fqn}.{STEP_KEY}"


def _looks_synthetic(fqn: str, keys: list[str], data: Mapping[str, Any]) -> bool:
    step_key = _step_key(fqn)
    if step_key not in keys:
        return False
    if not _step_is_one(data[step_key]):
        return False
    return all(isinstance(data[k], torch.Tensor) for k in keys if k != step_key)


def _any_nonzero(fqn: str, keys: list[str], data: Mapping[str, Any]) -> bool:
    step_key = _step_key(fqn)
    for key in keys:
        if key == step_key:
            continue
        value = data[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if bool(torch.count_nonzero(local.detach()).item()):
            return True
    return False
