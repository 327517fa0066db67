"""``sparse_ckpt.integrations.dsd``: torch DSD's functions, exact and sparse, through ``install()``.

One spawned 2-rank Gloo job (FSDP2 over an explicit CPU mesh) runs every multi-rank case on one
process group: the issue's MoE (:mod:`dsd_moe`: 40 parameters, 22 with gradients, ``vision`` in
its own group whose lr a scheduler moves) saved after step 3 with DSD's calls and ``dcp.save``,
resumed in a fresh model and optimizer the way trainers do it (``get_optimizer_state_dict`` for the
load target, ``dcp.load`` with the trainer's own planner, ``set_optimizer_state_dict``), compared
bit for bit with the uninterrupted run. The DSD names are imported here, at module level, before
``install()`` runs in the ranks: the trainer's import order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dsd_moe
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import cpu_mesh, full_copy, run_ranks
from helpers import assert_deep_equal
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

import sparse_ckpt.integrations.dsd as sc_dsd

pytestmark = pytest.mark.usefixtures("forbid_fork")

NESTED = StateDictOptions()
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainerPlanner(DefaultLoadPlanner):
    """A trainer's own planner subclass (calls ``super().set_up_planner``)."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)


def sharded(seed: int = 0) -> dsd_moe.Moe:
    m = dsd_moe.model(seed)
    mesh = cpu_mesh()
    for layer in m.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def fresh() -> tuple[dsd_moe.Moe, torch.optim.Optimizer, Any]:
    m = sharded()
    opt = dsd_moe.optimizer(m)
    return m, opt, dsd_moe.scheduler(opt)


def snapshot(m: Any, opt: Any) -> dict[str, Any]:
    return {"params": {n: full_copy(p) for n, p in m.named_parameters()}, "lrs": [g["lr"] for g in opt.param_groups]}


def save(m: Any, opt: Any, sched: Any, path: str, options: StateDictOptions) -> None:
    """What a trainer's save does: DSD's dicts into ``dcp.save`` (the scheduler beside them)."""
    dcp.save({"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt, options=options)}, checkpoint_id=path)
    torch.save(sched.state_dict(), f"{path}/sched-{dist.get_rank()}.pt")


def resume(path: str, options: StateDictOptions, planner: Any) -> tuple[Any, Any, Any]:
    """What a trainer's resume does, into a fresh model, optimizer and scheduler."""
    m, opt, sched = fresh()
    state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt, options=options)}
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_model_state_dict(m, state["model"])
    set_optimizer_state_dict(m, opt, state["optim"], options=options)
    sched.load_state_dict(torch.load(f"{path}/sched-{dist.get_rank()}.pt", weights_only=False))
    return m, opt, sched


def check_exact(rank: int, path: str, resumed: tuple[Any, Any, Any], reference: dict[str, Any], where: str) -> None:
    m, opt, sched = resumed
    assert len(opt.state) == dsd_moe.STEPPED, f"{where}: {len(opt.state)} states"
    dsd_moe.train(m, opt, sched, range(3, 5), rank)
    assert_deep_equal(snapshot(m, opt), reference, where, nan_equal="none")


def cases(rank: int, world_size: int, root: str) -> None:
    # The uninterrupted run and the checkpoint after step 3, in both layouts.
    m, opt, sched = fresh()
    dsd_moe.train(m, opt, sched, range(3), rank)
    before = len(opt.state)
    assert before == dsd_moe.STEPPED

    # Stock torch DSD (pinned): the save holds the 22 states; the resume target of a fresh
    # optimizer gets DSD's synthetic step (40 states, 18 invented) and the load fails.
    save(m, opt, sched, f"{root}/stock", NESTED)
    m2, opt2, _ = fresh()
    target = {"model": get_model_state_dict(m2), "optim": get_optimizer_state_dict(m2, opt2, options=NESTED)}
    assert len(opt2.state) == dsd_moe.PARAMS  # DSD's synthetic step on the fresh optimizer: 18 invented
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.state\..*\.step"):
        dcp.load(target, checkpoint_id=f"{root}/stock")

    sc_dsd.install()
    try:
        for name, options in (("nested", NESTED), ("flat", FLAT)):
            save(m, opt, sched, f"{root}/{name}", options)
            assert len(opt.state) == before  # a save changes nothing
        reference_model, reference_opt, reference_sched = m, opt, sched
        dsd_moe.train(reference_model, reference_opt, reference_sched, range(3, 5), rank)
        reference = snapshot(reference_model, reference_opt)
        for name, options in (("nested", NESTED), ("flat", FLAT)):
            for planner in (None, DefaultLoadPlanner(), TrainerPlanner()):
                where = f"{name}, planner {type(planner).__name__}"
                check_exact(rank, root, resume(f"{root}/{name}", options, planner), reference, where)
        # a stock checkpoint loads as it is (the state DSD saved, nothing invented on top)
        _m3, opt3, _ = resume(f"{root}/stock", NESTED, None)
        assert len(opt3.state) == dsd_moe.STEPPED
    finally:
        sc_dsd.uninstall()


def test_dsd_cases_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(cases, 2, str(tmp_path), timeout=300)
