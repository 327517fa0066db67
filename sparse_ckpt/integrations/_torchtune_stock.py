"""What `sparse_ckpt.integrations.torchtune` reads besides its own checkpoints: torchtune 0.6.1's stock ones.

- **sync** (``recipe_state.pt``): torch DSD's nested full dict (``state`` by FQN, ``param_groups``
  with FQN lists), as ``training.get_full_optimizer_state_dict`` returns it. The integration writes
  the same layout plus one marker entry (`sync_marker`); a dict without it is stock and is
  migrated by `migrate_full`.
- **async** (``dist_epoch_N``, DCP): ``optimizer.state_dict()`` as it is, keyed by parameter *id*:
  items ``optimizer.state.<id>.<key>`` (this rank's shards as DTensors) and
  ``optimizer.param_groups.<index>.<setting>`` (``params``: the list of ids). `TuneOptimizerState`
  builds a load target for those items from the checkpoint's metadata (`stock_target`), maps each
  id to the FQN of the parameter that has that id in the target optimizer (ids are positions in
  ``param_groups`` order: the same recipe config gives the same order; group sizes are checked),
  and loads the result like a sync one.

Both give a `MigrationReport`: the state kept (``step == 1`` named as possibly synthetic), the
state dropped as synthetic (opt-in), the parameters left without state. No trainer package is
imported here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from .._dcp.stateful import SparseOptimizerState
from .._format.keys import PLANNER_GUARD_KEY, STATE_PREFIX
from .._fqn import build_fqn_map
from .._leaves import SINGLE_LEAF
from ..errors import CheckpointFormatError, CheckpointMismatchError
from ._stock_migration import DroppedState, KeptState, MigrationReport, drop_synthetic_state, step_one_fqns
from .dsd import functions as dsd

__all__ = ["MARKER", "TuneOptimizerState", "migrate_full", "split_marker", "sync_marker"]

MARKER = "sparse_ckpt"
"""The entry next to ``state`` and ``param_groups`` in the integration's sync optimizer dicts."""
_MARKER_VALUE = {"layout": "dsd-nested", "version": 1}
STATE, PARAM_GROUPS, PARAMS = "state", "param_groups", "params"
_STOCK_HINT = (
    "torchtune's stock async checkpoint (optimizer.state_dict() by parameter id) is read by position: "
    "build the optimizer with the same param groups as the run that saved it, or resume from its sync "
    "recipe_state.pt"
)


def sync_marker() -> dict[str, Any]:
    """The marker entry of a sync optimizer dict the integration writes."""
    return {MARKER: dict(_MARKER_VALUE)}


def split_marker(full_sd: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(the dict without the marker, whether the integration wrote it)``."""
    marker = full_sd.get(MARKER)
    osd = {k: v for k, v in full_sd.items() if k != MARKER}
    if marker is None:
        return osd, False
    if not (
        isinstance(marker, Mapping)
        and marker.get("layout") == _MARKER_VALUE["layout"]
        and isinstance(marker.get("version"), int)
        and marker["version"] <= _MARKER_VALUE["version"]
    ):
        raise CheckpointFormatError(
            f"the optimizer dict's {MARKER!r} entry is {marker!r}: written by a newer sparse_ckpt (this one reads "
            f"version {_MARKER_VALUE['version']} of layout {_MARKER_VALUE['layout']!r}); upgrade sparse_ckpt"
        )
    return osd, True


def migrate_full(
    model: Any, optimizer: Any, osd: dict[str, Any], checkpoint_id: str, drop: bool
) -> tuple[dict[str, Any], MigrationReport]:
    """A stock nested optimizer dict (state by FQN) to load as saved, minus the synthetic state when
    ``drop``; and its report. Every rank of the default process group calls it (``drop`` compares
    values across ranks)."""
    state = osd.get(STATE)
    if not isinstance(state, Mapping) or not isinstance(osd.get(PARAM_GROUPS), (list, tuple)):
        raise CheckpointFormatError(
            f"{checkpoint_id}: the optimizer entry is not torch DSD's nested layout (a 'state' mapping and a "
            f"'param_groups' list); got entries {sorted(map(str, osd))[:4]}"
        )
    flat: dict[str, Any] = {}
    by_fqn: dict[str, list[str]] = {}
    for fqn, values in state.items():
        for key, value in values.items() if isinstance(values, Mapping) else ():
            flat[f"{STATE_PREFIX}{fqn}.{key}"] = value
            by_fqn.setdefault(str(fqn), []).append(f"{STATE_PREFIX}{fqn}.{key}")
    dropped = drop_synthetic_state(flat, by_fqn) if drop else []
    gone = set(dropped)
    kept = step_one_fqns(flat, {fqn: keys for fqn, keys in by_fqn.items() if fqn not in gone})
    fmap = build_fqn_map(model)
    with_state = {fmap.resolve(str(fqn)) for fqn in state if fqn not in gone}
    stateless = tuple(
        fqn
        for group in optimizer.param_groups
        for p in group[PARAMS]
        if (fqn := fmap.fqn_of.get(id(p))) is not None and fqn not in with_state
    )
    report = MigrationReport(
        checkpoint_id,
        dropped=tuple(DroppedState(SINGLE_LEAF, fqn, tuple(by_fqn[fqn])) for fqn in dropped),
        stateless={SINGLE_LEAF: stateless},
        possibly_synthetic=tuple(KeptState(SINGLE_LEAF, fqn, tuple(by_fqn[fqn])) for fqn in kept),
        trainer="torchtune",
    )
    return {**osd, STATE: {fqn: v for fqn, v in state.items() if fqn not in gone}}, report


class TuneOptimizerState(SparseOptimizerState):
    """The optimizer entry of the integration's async load: a `SparseOptimizerState` that also reads
    torchtune's stock async checkpoints (see the module doc)."""

    def __init__(self, model: Any, optimizer: Any, *, checkpoint_id: str, drop_synthetic: bool) -> None:
        super().__init__(model, optimizer)
        self.checkpoint_id = checkpoint_id
        self.drop_synthetic = drop_synthetic
        self.stock = False
        """Set by `stock_target`: the checkpoint's optimizer entry is stock torchtune's."""
        self.report: MigrationReport | None = None

    def stock_target(self, metadata: Metadata, where: str) -> dict[str, Any] | None:
        """``None`` when the integration wrote the checkpoint's ``where`` entry; for a stock one, the
        id-keyed dict ``dcp.load`` fills from it (state tensors shaped like their parameter are
        DTensors placed like it, other tensors plain, settings placeholders)."""
        keys = metadata.state_dict_metadata
        self.stock = False
        if f"{where}.{PLANNER_GUARD_KEY}" in keys:
            return None
        state_re = re.compile(rf"^{re.escape(where)}\.state\.(\d+)\.(.+)$")
        group_re = re.compile(rf"^{re.escape(where)}\.param_groups\.(\d+)\.(.+)$")
        params = self._params_by_id()
        state: dict[int, dict[str, Any]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for key, md in keys.items():
            if m := state_re.match(key):
                pid, part = int(m.group(1)), m.group(2)
                state.setdefault(pid, {})[part] = _placeholder(md, params.get(pid), key)
            elif m := group_re.match(key):
                groups.setdefault(int(m.group(1)), {})[m.group(2)] = None
        if not groups:
            raise CheckpointMismatchError(
                f"{self.checkpoint_id}: the checkpoint has no {where!r} entries (written at the end of training, or "
                f"without the optimizer); resume it with enable_async_checkpointing off, or start the optimizer fresh"
            )
        self.stock = True
        return {STATE: state, PARAM_GROUPS: [groups[i] for i in sorted(groups)]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore as `SparseOptimizerState` does; a stock checkpoint is mapped from ids to FQNs,
        migrated (`migrate_full`) and loaded by FQN."""
        self.report = None
        if not self.stock:
            super().load_state_dict(state_dict)
            return
        osd, report = migrate_full(
            self.model, self.optimizer, self._by_fqn(state_dict), self.checkpoint_id, self.drop_synthetic
        )
        dsd.set_optimizer_state_dict(self.model, self.optimizer, osd, options=StateDictOptions())
        self.report = report

    def _params_by_id(self) -> dict[int, torch.Tensor]:
        """torch's parameter ids of the target optimizer: positions in ``param_groups`` order."""
        order = [p for group in self.optimizer.param_groups for p in group[PARAMS]]
        return dict(enumerate(order))

    def _by_fqn(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The id-keyed dict DCP filled, keyed by FQN (DSD's nested layout)."""
        fmap = build_fqn_map(self.model)
        saved, live = list(data[PARAM_GROUPS]), self.optimizer.param_groups
        sizes = [len(g[PARAMS]) for g in live]
        saved_ids = [list(g.get(PARAMS) or ()) for g in saved]
        expected, start = [], 0
        for n in sizes:
            expected.append(list(range(start, start + n)))
            start += n
        if saved_ids != expected:
            raise CheckpointMismatchError(
                f"{self.checkpoint_id}: the checkpoint's param groups hold parameter ids "
                f"{[(ids[:1] + ids[-1:]) for ids in saved_ids]} ({[len(i) for i in saved_ids]} per group), the "
                f"optimizer's groups {sizes} parameters; {_STOCK_HINT}"
            )
        fqns = [fmap.fqn_of[id(p)] for group in live for p in group[PARAMS]]
        state = {fqns[pid]: dict(values) for pid, values in data[STATE].items()}
        groups = [
            {**{k: v for k, v in g.items() if k != PARAMS}, PARAMS: [fqns[i] for i in ids]}
            for g, ids in zip(saved, saved_ids)
        ]
        return {STATE: state, PARAM_GROUPS: groups}


def _placeholder(md: Any, param: torch.Tensor | None, key: str) -> Any:
    """A load target for one stock item: like its parameter where it has the parameter's shape."""
    if isinstance(md, BytesStorageMetadata):
        return None
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointFormatError(f"checkpoint item {key!r}: unexpected metadata {type(md).__name__}")
    dtype = md.properties.dtype
    if param is not None and tuple(md.size) == tuple(param.shape):
        if isinstance(param, DTensor):
            return torch.zeros_like(param.detach(), dtype=dtype)
        return torch.zeros(tuple(md.size), dtype=dtype, device=param.device)
    return torch.zeros(tuple(md.size), dtype=dtype)
