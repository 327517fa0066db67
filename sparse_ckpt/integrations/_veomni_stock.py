"""VeOmni's stock checkpoints: which optimizer a checkpoint holds (`optimizer_layout`), the
refusal that names the opt-in migration, and the load target that migrates a stock optimizer
(`_StockTarget`) for `sparse_ckpt.integrations.veomni.load_stock_checkpoint`."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from .._dcp.items import allocate_item
from .._dcp.paths import metadata_path
from .._dist import multi_rank
from .._format.keys import (
    GROUPS_PREFIX,
    PACKED_PREFIX,
    PLANNER_GUARD_KEY,
    SCALARS_PREFIX,
    STATE_PREFIX,
    last_part,
    owner_fqn,
)
from .._fqn import FqnMap
from .._leaves import named_leaves
from .._load.load import load_owned
from ._stock_migration import LeafGaps, flat_fqns, state_keys_by_fqn, step_one_fqns
from ._stock_migration import MigrationReport as StockMigrationReport

OPTIMIZER_KEY = "optimizer"
"""The top-level key VeOmni's checkpointer saves the optimizer under."""
_PREFIX = f"{OPTIMIZER_KEY}."


def optimizer_layout(metadata: Metadata) -> str:
    """Which optimizer a VeOmni checkpoint holds under ``optimizer``: ``"sparse"`` (sparse_ckpt's),
    ``"stock"`` (stock VeOmni's: torch DSD's flat or nested layout) or ``"none"``."""
    found = False
    for key in metadata.state_dict_metadata:
        if key.startswith(_PREFIX):
            inner = key[len(_PREFIX) :]
            if inner == PLANNER_GUARD_KEY or inner.startswith((PACKED_PREFIX, SCALARS_PREFIX)):
                return "sparse"
            found = True
    return "stock" if found else "none"


def _stock_refusal(path: str, metadata: Metadata) -> str:
    items = sum(1 for key in metadata.state_dict_metadata if key.startswith(_PREFIX))
    return (
        f"{path} holds an optimizer saved by VeOmni's stock DistributedCheckpointer (torch DSD's layout, {items} "
        f"items under {OPTIMIZER_KEY!r}), not by sparse_ckpt: it may lack the settings (lr) of sub-optimizers "
        "that had no state and the state of parameters that never stepped. Opt in to migrating it: "
        "sparse_ckpt.integrations.veomni.load_stock_checkpoint(path, state) (returns a per-leaf report of what "
        "had no saved settings or state), or install(migrate_stock=True) so that load() migrates it and warns "
        "with that report. Checkpoints saved afterwards are sparse_ckpt's"
    )


class _StockTarget:
    """The load target for a stock VeOmni optimizer (DSD flat or nested), read key by key.

    Keys are the checkpoint's own flattened keys below ``optimizer.`` (DCP matches flattened keys,
    so a flat-keyed target reads a nested checkpoint too); state tensors shaped like their
    parameter are allocated like it (a DTensor: same mesh and placements), so each rank reads its
    shard. `apply` turns nested ``param_groups.{i}.{key}`` entries into the flat
    ``param_groups.{fqn}.{key}`` entries ``load_sparse_state_dict`` reads, loads non-strictly and
    reports the gaps.
    """

    def __init__(self, metadata: Metadata, fmap: FqnMap) -> None:
        self.fmap = fmap
        self.target: dict[str, Any] = {}
        self.nested_groups: dict[int, dict[str, str]] = {}
        for key, md in metadata.state_dict_metadata.items():
            if not key.startswith(_PREFIX):
                continue
            inner = key[len(_PREFIX) :]
            path = metadata_path(metadata, key)
            if len(path) == 4 and path[1] == "param_groups" and isinstance(path[2], int):
                self.nested_groups.setdefault(path[2], {})[str(path[3])] = inner
                self.target[inner] = allocate_item(md, None, "")
            elif inner.startswith(STATE_PREFIX):
                fqn = owner_fqn(inner[len(STATE_PREFIX) :], fmap.canonical)
                if fqn is None:
                    continue  # another rank's parameter
                like = fmap.param_of[fmap.canonical[fqn]]
                self.target[inner] = allocate_item(md, like, last_part(inner))
            else:
                self.target[inner] = allocate_item(md, None, "")

    def apply(self, path: str, model: Any, optimizer: Any) -> StockMigrationReport:
        """Load what was read into ``optimizer`` (``strict=False``) and report the gaps per leaf."""
        data = dict(self.target)
        for _index, keys in sorted(self.nested_groups.items()):
            values = {name: data.pop(inner) for name, inner in keys.items()}
            fqns = values.pop("params", None) or []
            for fqn in fqns:
                for name, value in values.items():
                    data[f"{GROUPS_PREFIX}{fqn}.{name}"] = value
        fmap = self.fmap
        saved_fqns = flat_fqns(data)
        settings_of = {fmap.resolve(fqn) for fqn in saved_fqns}
        step_one = {fmap.resolve(fqn) for fqn in step_one_fqns(data, state_keys_by_fqn(data, saved_fqns))}
        state_of = {owner_fqn(k[len(STATE_PREFIX) :], fmap.canonical) for k in data if k.startswith(STATE_PREFIX)}
        state_of = {fmap.resolve(f) for f in state_of if f is not None}
        load_owned(model, optimizer, data, strict=False, unowned_are_other_ranks=multi_rank(), fmap=fmap)
        leaves = []
        for name, opt in named_leaves(optimizer):
            fqns = [fmap.fqn_of[id(p)] for group in opt.param_groups for p in group["params"]]
            leaves.append(
                LeafGaps(
                    leaf=name,
                    params=len(fqns),
                    no_settings=[f for f in fqns if f not in settings_of],
                    no_state=[f for f in fqns if f not in state_of],
                    possibly_synthetic=[f for f in fqns if f in step_one],
                )
            )
        return StockMigrationReport(checkpoint_id=path, leaves=tuple(leaves), trainer="VeOmni")
