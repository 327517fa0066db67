"""Exact resume: save after N steps, restore into fresh objects, train M more == N+M uninterrupted.

A small MoE-like model with top-1 routing where experts 2 and 3 are never routed (masked out),
a MultiOptimizer with an AdamW leaf (experts, tensor lrs, two groups), an SGD-momentum leaf
(dense) and a third leaf (head) whose grads are dropped so it never steps, and one LR
scheduler per leaf. Parameters and optimizer state must match bit for bit, and the never-routed
experts and the head must still have no optimizer state.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import assert_deep_equal, clone_state_dict, fqn_view, randomize, route_top1
from torch import nn

import sparse_ckpt as sc

N_STEPS = 3
M_STEPS = 3
N_EXPERTS = 4
ROUTED = (0, 1)  # experts 2 and 3 are masked out of routing: never any gradient
DIM = 4


class _MoE(nn.Module):
    """``embed -> top-1 of N_EXPERTS experts (only ROUTED allowed) -> head``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(N_EXPERTS))
        self.head = nn.Linear(DIM, 1)
        mask = torch.full((N_EXPERTS,), float("-inf"))
        mask[list(ROUTED)] = 0.0
        self.register_buffer("route_mask", mask)
        randomize(self, seed, scale=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route every row to one allowed expert, gate it, add it residually, project."""
        h = torch.tanh(self.embed(x))
        logits = self.router(h) + self.route_mask
        return self.head(h + route_top1(h, logits, self.experts))


def _build(model: _MoE) -> tuple[sc.MultiOptimizer, list[torch.optim.lr_scheduler.LRScheduler]]:
    experts = torch.optim.AdamW(
        [
            {
                "params": list(model.experts[0].parameters()) + list(model.experts[1].parameters()),
                "lr": torch.tensor(0.01),
            },
            {
                "params": list(model.experts[2].parameters()) + list(model.experts[3].parameters()),
                "lr": torch.tensor(0.02),
            },
        ],
        weight_decay=0.1,
    )
    dense = torch.optim.SGD(list(model.embed.parameters()) + list(model.router.parameters()), lr=0.05, momentum=0.9)
    head = torch.optim.Adam(model.head.parameters(), lr=0.01)
    opt = sc.MultiOptimizer(model, {"experts": experts, "dense": dense, "head": head})
    scheds: list[torch.optim.lr_scheduler.LRScheduler] = [
        torch.optim.lr_scheduler.StepLR(experts, step_size=2, gamma=0.5),
        torch.optim.lr_scheduler.LinearLR(dense, start_factor=0.5, total_iters=4),
        torch.optim.lr_scheduler.ExponentialLR(head, gamma=0.5),
    ]
    return opt, scheds


def _train_step(model: _MoE, opt: sc.MultiOptimizer, scheds: list[Any], t: int) -> None:
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1000 + t))
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    for p in model.head.parameters():  # the head leaf never steps
        p.grad = None
    opt.step()
    for s in scheds:
        s.step()


def _run(fmt: str | None) -> tuple[_MoE, sc.MultiOptimizer]:
    model = _MoE(seed=0)
    opt, scheds = _build(model)
    for t in range(N_STEPS):
        _train_step(model, opt, scheds, t)
    if fmt is not None:
        model_sd = clone_state_dict(model.state_dict())
        opt_sd = clone_state_dict(sc.sparse_state_dict(model, opt, format=fmt))
        sched_sds = [copy.deepcopy(s.state_dict()) for s in scheds]
        del model, opt, scheds
        model = _MoE(seed=1)
        opt, scheds = _build(model)
        model.load_state_dict(model_sd)
        sc.load_sparse_state_dict(model, opt, opt_sd)
        for s, ssd in zip(scheds, sched_sds):
            s.load_state_dict(ssd)
    for t in range(N_STEPS, N_STEPS + M_STEPS):
        _train_step(model, opt, scheds, t)
    return model, opt


# Leaf views are compared without key order, with NaN never equal and dicts required to be dicts.
SAME = {"check_order": False, "nan_equal": "none", "mapping": dict}


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[_MoE, sc.MultiOptimizer]:
    """The reference N+M-step run (backend independent: nothing is saved)."""
    return _run(None)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_resume_is_bit_exact(fmt: str, uninterrupted: tuple[_MoE, sc.MultiOptimizer]) -> None:
    ref_model, ref_opt = uninterrupted
    model, opt = _run(fmt)
    for (name, p), (ref_name, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert name == ref_name and torch.equal(p, q), name
    for (leaf, o), (ref_leaf, r) in zip(opt.leaves(), ref_opt.leaves()):
        assert leaf == ref_leaf
        state, groups = fqn_view(model, [o], groups=True)
        ref_state, ref_groups = fqn_view(ref_model, [r], groups=True)
        assert_deep_equal(state, ref_state, f"{leaf}.state", **SAME)
        assert_deep_equal(groups, ref_groups, f"{leaf}.param_groups", **SAME)

    # never-routed experts and the never-stepping head still have no optimizer state
    stateful = {n for n, p in model.named_parameters() if any(p in o.state for _, o in opt.leaves())}
    for e in range(N_EXPERTS):
        has = {f"experts.{e}.weight", f"experts.{e}.bias"} & stateful
        assert bool(has) == (e in ROUTED), (e, has)
    assert not {"head.weight", "head.bias"} & stateful
    assert len(opt["head"].state) == 0
    assert opt["head"].param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** (N_STEPS + M_STEPS))
    # the never-routed experts' group kept its own (scheduled) tensor lr, not shared with group 0
    g0, g1 = opt["experts"].param_groups
    assert g0["lr"] is not g1["lr"] and torch.equal(g1["lr"], 2 * g0["lr"])


def test_the_run_exercises_what_it_claims(uninterrupted: tuple[_MoE, sc.MultiOptimizer]) -> None:
    """Both allowed experts really were routed, the others never: the test above is not vacuous."""
    model, opt = uninterrupted
    experts = opt["experts"]
    for e in range(N_EXPERTS):
        assert (model.experts[e].weight in experts.state) == (e in ROUTED)
    assert len(opt["dense"].state) == 3 and all("momentum_buffer" in s for s in opt["dense"].state.values())
