"""The trainer drills (a stock trainer's own checkpointing resumed exactly): the pieces every trainer's drill shares.

Each drill (``tests/integrations/test_lightning.py``, ``test_olmo_core.py``, ``test_nemo_automodel.py``)
trains the MoE of :mod:`dsd_moe` (40 parameters, 22 with gradients, ``vision`` in its own group whose
lr a scheduler moves) on 2 Gloo ranks, FSDP2 over an explicit CPU mesh, saves after step
:data:`SAVE_AT` through the trainer's own checkpoint API and resumes in a fresh set of processes
(a second :func:`_dist.run_ranks` job), then runs to step :data:`STEPS` and compares with the
uninterrupted run:

- :func:`parallelize` / :func:`sharded`: the FSDP2 layout (each MoE layer and the root);
- :func:`sgd`: SGD with momentum over :func:`dsd_moe.param_groups` (NeMo Automodel's failing case);
- :func:`outcome`: full parameters, optimizer state by FQN, groups, the scheduler's state and the
  number of parameters with state (a collective: every rank calls it at the same point);
- :func:`save_reference` / :func:`load_reference`: the uninterrupted run's outcome across jobs;
- :func:`assert_resumed`: the resumed run equals it bit for bit, 22 parameters with state, and
  every group's lr is the scheduler's;
- :func:`doc_block`: the block of a trainer's page (docs/integrations/) a drill runs as written;
- :data:`MARKS`: the drill modules' ``pytestmark``.

A drill module imports this one as ``drill`` (``drill.outcome``, ``drill.SAVE_AT``...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dsd_moe
import pytest
import torch
import torch.distributed as dist
from _dist import assert_snapshots_equal, cpu_mesh, full_snapshot
from doc_blocks import ROOT, Block, blocks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

SAVE_AT = 3
"""The drills save after this many optimizer steps."""
STEPS = 5
"""The uninterrupted run's length (the resumed run steps from :data:`SAVE_AT` to here)."""
PAGES = ROOT / "docs" / "integrations"
"""The trainer pages; each drill names its own (``PAGES / "lightning.md"``)."""
FRESH_LRS = [0.01, dsd_moe.VISION_LR]
"""The lrs of a fresh :func:`dsd_moe.optimizer` (what a failed resume leaves)."""
MARKS = [
    pytest.mark.slow,  # a trainer drill: the fast tier (-m 'not slow') leaves it out
    pytest.mark.usefixtures("forbid_fork"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
]
"""Every trainer drill module's ``pytestmark`` (the HF ``Trainer`` drills' too): slow, no fork, trainers' warnings."""


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over ``mesh``: each MoE layer, then the root (the ``vision`` tower and the head with it)."""
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sharded(seed: int = 0) -> dsd_moe.Moe:
    """A fresh :func:`dsd_moe.model` sharded over the whole process group (:func:`_dist.cpu_mesh`)."""
    return parallelize(dsd_moe.model(seed), cpu_mesh())  # type: ignore[return-value]


def sgd(model: nn.Module) -> torch.optim.SGD:
    """SGD with momentum (state: ``momentum_buffer``) over :func:`dsd_moe.param_groups`."""
    return torch.optim.SGD(dsd_moe.param_groups(model), lr=0.01, momentum=0.9)


def outcome(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Full parameters, state and groups (:func:`_dist.full_snapshot`), the scheduler's state (its
    lambdas aside) and ``with_state``, the number of parameters the optimizer holds state for."""
    snap = full_snapshot(model, optimizer)
    snap["sched"] = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    snap["with_state"] = len(optimizer.state)
    snap["lrs"] = [g["lr"] for g in optimizer.param_groups]
    return snap


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Two :func:`outcome` results are equal bit for bit (state keys in any order: a multi-rank DCP
    load gives them in the metadata's order)."""
    assert_snapshots_equal(got, want, where, state_key_order=False)
    assert got["sched"] == want["sched"], f"{where}: scheduler {got['sched']} vs {want['sched']}"
    assert (got["with_state"], got["lrs"]) == (want["with_state"], want["lrs"]), where


def assert_resumed(got: dict[str, Any], reference: dict[str, Any], where: str) -> None:
    """The resumed run's :func:`outcome` equals the uninterrupted run's: state for the 22 parameters
    that stepped and no other, every group's lr the scheduler's, everything bit for bit."""
    assert got["with_state"] == dsd_moe.STEPPED, f"{where}: {got['with_state']} parameters with state"
    assert got["lrs"] == got["sched"]["_last_lr"] == reference["lrs"], f"{where}: lrs {got['lrs']}"
    assert_same(got, reference, where)


def save_reference(root: str, name: str, result: dict[str, Any]) -> None:
    """Rank 0 keeps the uninterrupted run's outcome for the resume job."""
    if dist.get_rank() == 0:
        torch.save(result, Path(root) / f"{name}.pt")
    dist.barrier()


def load_reference(root: str, name: str) -> dict[str, Any]:
    return torch.load(Path(root) / f"{name}.pt", weights_only=False)


def doc_block(page: Path, marker: str) -> Block:
    """The one ``python`` block of the Markdown file ``page`` that contains ``marker``."""
    found = [b for b in blocks(page) if marker in b.code]
    assert len(found) == 1, f"{page.name}: {len(found)} python blocks contain {marker!r}"
    return found[0]


__all__ = [
    "FRESH_LRS",
    "PAGES",
    "SAVE_AT",
    "STEPS",
    "assert_resumed",
    "assert_same",
    "doc_block",
    "load_reference",
    "outcome",
    "parallelize",
    "save_reference",
    "sgd",
    "sharded",
]
