"""Reading optimizer checkpoints that a trainer's stock checkpointer wrote in the flat FQN layout.

torchtitan's ``OptimizersContainer.state_dict`` writes ``state.{fqn}.{key}`` and
``param_groups.{fqn}.{setting}`` for every parameter (torch DSD's flat layout, which sparse_ckpt
reads as its ``flat`` format). Before it reads an optimizer that has no state yet it runs a
*synthetic step* (zero gradients, lr 0), so a never-stepped optimizer is saved with invented
state: ``step == 1`` and all-zero moments. `drop_synthetic_state` finds and removes such
entries from a loaded flat dict (opt-in: a real first step on a zero gradient looks the same),
`step_one_fqns` finds every parameter whose kept state *may* be such state (its ``step`` is 1:
Adam with ``weight_decay`` folds the weights into the synthetic gradient, so its moments are not
zero), and `MigrationReport` says what was dropped, what was kept that may be synthetic, and
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

from .._dist import world_and_rank
from .._format.keys import STATE_PREFIX, STEP_KEY, is_state_item, owner_fqn, split_group_key
from .._text import first_n

__all__ = [
    "DroppedState",
    "KeptState",
    "LeafGaps",
    "MigrationReport",
    "drop_synthetic_state",
    "flat_fqns",
    "state_keys_by_fqn",
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


@dataclass
class LeafGaps:
    """What a stock checkpoint had no entries for, for one optimizer leaf (canonical FQNs, in group order)."""

    leaf: str
    params: int
    """Parameters of the leaf."""
    no_settings: list[str] = field(default_factory=list)
    """Parameters without saved param-group settings: their group kept the optimizer's current settings."""
    no_state: list[str] = field(default_factory=list)
    """Parameters without saved state: they have none (as before their first step)."""
    possibly_synthetic: list[str] = field(default_factory=list)
    """Parameters whose saved state was loaded with ``step == 1``: stock VeOmni saves through torch
    DSD, which runs a synthetic step (zero gradients, lr 0) on an optimizer without state and saves
    what it invents; for a leaf that had never stepped that state is invented (Adam with
    ``weight_decay``: non-zero moments) and the resume is not exact. A real first step looks the same."""


@dataclass(frozen=True)
class MigrationReport:
    """What a migrating load of a stock trainer's optimizer checkpoint did on this rank: the one
    report type of the integrations (torchtitan's ``migration_report``, VeOmni's
    ``StockMigrationReport``)."""

    checkpoint_id: str
    dropped: tuple[DroppedState, ...] = ()
    """Every parameter whose saved state was dropped as synthetic (``drop_synthetic_state=True``)."""
    stateless: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Leaf -> FQNs of this rank's parameters that have no state after the load (never saved, or
    dropped): they get state on their first real step, as in an uninterrupted run."""
    possibly_synthetic: tuple[KeptState, ...] = ()
    """Every parameter of this rank whose saved state was kept with ``step == 1`` (see
    `KeptState`): where a leaf had never stepped when the stock checkpointer saved it, this
    is invented state, and the resume is not exact."""
    leaves: tuple[LeafGaps, ...] = ()
    """Per leaf, what the checkpoint had no settings or state for (VeOmni's migration)."""
    trainer: str = ""
    """Whose stock checkpoint it was, for the text (``"VeOmni"``)."""

    @property
    def path(self) -> str:
        """The checkpoint migrated (``checkpoint_id``)."""
        return self.checkpoint_id

    @property
    def complete(self) -> bool:
        """Every parameter had saved settings and state."""
        return not any(g.no_settings or g.no_state for g in self.leaves)

    @property
    def exact(self) -> bool:
        """Nothing kept that a synthetic step may have invented (parameters without state are exact:
        they get state on their first real step)."""
        return not self.possibly_synthetic and not any(g.possibly_synthetic for g in self.leaves)

    def summary(self, limit: int = 10) -> list[str]:
        """One line per leaf that lost or lacks state (at most ``limit`` FQNs named per line)."""
        lines = []
        for leaf, fqns in _by_leaf(self.dropped).items():
            lines.append(
                f"{self.checkpoint_id}: leaf {leaf!r}: dropped the synthetic-step state (step == 1, all-zero "
                f"moments) of {len(fqns)} parameter(s): {_names(fqns, limit)}"
            )
        for leaf, fqns in _by_leaf(self.possibly_synthetic).items():
            lines.append(
                f"{self.checkpoint_id}: leaf {leaf!r}: kept the state of {len(fqns)} parameter(s) with step == 1 "
                f"that a synthetic step may have invented (its moments are not all zero, e.g. Adam with "
                f"weight_decay, or drop_synthetic_state is off); the resume is exact only if they really stepped "
                f"once: {_names(fqns, limit)}"
            )
        for leaf, fqns in self.stateless.items():
            if fqns:
                lines.append(
                    f"{self.checkpoint_id}: leaf {leaf!r}: {len(fqns)} parameter(s) have no state: "
                    f"{_names(fqns, limit)}"
                )
        return lines

    def __str__(self) -> str:
        header = (
            f"migrated the stock {self.trainer} optimizer checkpoint {self.checkpoint_id} into sparse_ckpt's "
            "checkpointer:"
        )
        lines = [header] if self.leaves else []
        for g in self.leaves:
            lines.append(
                f"  leaf {g.leaf!r} ({g.params} params): {len(g.no_settings)} without saved settings"
                f"{_examples(g.no_settings, ' (kept the current settings: ', ')')}, {len(g.no_state)} without saved "
                f"state{_examples(g.no_state, ' (left without state: ', ')')}"
                + (
                    f", {len(g.possibly_synthetic)} loaded with step == 1 that DSD's synthetic step may have invented"
                    + _examples(g.possibly_synthetic, " (the resume is exact only if they really stepped once: ", ")")
                    if g.possibly_synthetic
                    else ""
                )
            )
        return "\n".join([*lines, *self.summary()])


def _by_leaf(entries: tuple[DroppedState, ...] | tuple[KeptState, ...]) -> dict[str, list[str]]:
    """The FQNs of ``entries``, by leaf, in order."""
    out: dict[str, list[str]] = {}
    for entry in entries:
        out.setdefault(entry.leaf, []).append(entry.fqn)
    return out


def _names(fqns: list[str] | tuple[str, ...], limit: int) -> str:
    return first_n(fqns, limit, more=" and {n} more")


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
    world, _rank = world_and_rank()
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, sorted(nonzero))
        nonzero = {fqn for part in gathered for fqn in part}
    dropped = sorted(fqn for fqn in candidates if fqn not in nonzero)
    for fqn in dropped:
        for key in by_fqn[fqn]:
            del data[key]
    return dropped


def step_one_fqns(data: Mapping[str, Any], by_fqn: Mapping[str, list[str]]) -> list[str]:
    """The FQNs (sorted) whose state in ``data`` has ``step == 1``: what a synthetic step writes, and
    what a real first step writes too (``by_fqn``: `state_keys_by_fqn` of ``data``)."""
    return sorted(
        fqn
        for fqn, keys in by_fqn.items()
        if _step_is_one(data.get(_step_key(fqn)) if _step_key(fqn) in keys else None)
    )


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


def _examples(fqns: list[str], before: str, after: str, limit: int = 5) -> str:
    if not fqns:
        return ""
    return before + first_n(fqns, limit, more=", ... {n} more") + after
