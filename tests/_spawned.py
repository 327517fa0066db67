"""Multi-rank helpers of the scale tests (stable keys, buffers drills): ranks started with the
``spawn`` start method, models sharded over an explicit CPU device mesh.

:func:`run_spawned` is ``_dist.run_ranks`` with ``spawn`` forced (``fork`` and the default mesh
crash on GPU hosts); the worker functions must be module-level functions (spawned ranks import
them by name). :class:`DrillNet` is an FSDP2 + expert-parallel model: ``dense`` (float32, 6 rows)
and ``proj`` (bfloat16) sharded over the mesh, experts ``experts.{i}`` plain on the ranks that own
them; every module's initial values depend only on its name, so any layout of it starts alike.
:func:`local_view` / :func:`merge_views` give comparable full values of what a rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any
from unittest import mock

import torch
import torch.multiprocessing as mp
from _dist import run_ranks
from helpers import assert_deep_equal
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import sparse_ckpt as sc

D = 6
"""Feature size: 6 rows shard 3/3 on 2 ranks and 2/2/2/0 (an empty shard) on 4."""
EXPERT_LR = 0.003
DENSE_LR = 0.0025


def run_spawned(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> None:
    """``_dist.run_ranks(fn, world_size, *args)`` with the ``spawn`` start method."""
    start = mp.start_processes

    def spawned(*a: Any, **k: Any) -> Any:
        k["start_method"] = "spawn"
        return start(*a, **k)

    with mock.patch.object(mp, "start_processes", spawned):
        run_ranks(fn, world_size, *args, timeout=timeout)


def cpu_mesh(world_size: int) -> Any:
    """The explicit 1-D CPU device mesh every sharded model of these tests uses."""
    return init_device_mesh("cpu", (world_size,))


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return make()
    finally:
        torch.random.set_rng_state(state)


class DrillNet(nn.Module):
    """``dense`` (float32) -> ``proj`` (bfloat16) -> the first of this rank's experts."""

    def __init__(self, experts: Iterable[int], seed: int = 0) -> None:
        super().__init__()
        self.dense = _seeded(seed * 1000 + 1, lambda: nn.Linear(D, D))
        self.proj = _seeded(seed * 1000 + 2, lambda: nn.Linear(D, D).to(torch.bfloat16))
        self.experts = nn.ModuleDict({str(i): _seeded(seed * 1000 + 100 + i, lambda: nn.Linear(D, D)) for i in experts})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.tanh(self.dense(x)).to(torch.bfloat16)).float()
        return self.experts[next(iter(self.experts))](h)


def build_drill(
    experts: Iterable[int], mesh: Any = None, seed: int = 0, state_layout: str = "buffers"
) -> tuple[DrillNet, sc.MultiOptimizer]:
    """A :class:`DrillNet` holding ``experts`` (``dense`` and ``proj`` sharded over ``mesh`` when
    given) with a MultiOptimizer: leaf ``dense`` (dense + proj, lr :data:`DENSE_LR`) and leaf
    ``experts`` (lr :data:`EXPERT_LR`)."""
    model = DrillNet(experts, seed)
    if mesh is not None:
        fully_shard(model.dense, mesh=mesh)  # not the root: the experts stay plain (expert parallel)
        fully_shard(model.proj, mesh=mesh)
    opt = sc.MultiOptimizer(
        model,
        {
            "dense": torch.optim.AdamW([*model.dense.parameters(), *model.proj.parameters()], lr=DENSE_LR),
            "experts": torch.optim.AdamW(model.experts.parameters(), lr=EXPERT_LR),
        },
        state_layout=state_layout,  # type: ignore[arg-type]
    )
    return model, opt


def train_drill(model: DrillNet, opt: sc.MultiOptimizer, steps: int, seed: int, rank: int) -> None:
    """``steps`` steps on this rank's data (FSDP averages the sharded gradients); only the first
    of the rank's experts gets a gradient."""
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(seed + 1000 * rank + i))
        model(x).pow(2).mean().backward()
        opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def local_view(model: nn.Module, opt: sc.MultiOptimizer) -> dict[str, Any]:
    """``fqn -> (full param, {key: full state}, settings)`` for every parameter this rank holds
    (full values of sharded ones: a collective, call it on every rank alike)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for _leaf, o in opt.leaves():
        for group in o.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                state = {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in o.state.get(p, {}).items()}
                out[names[id(p)]] = (_full(p), state, settings)
    return dict(sorted(out.items()))


def merge_views(views: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several ranks' :func:`local_view` as one (a parameter two ranks hold must be equal in both)."""
    out: dict[str, Any] = {}
    for view in views:
        for fqn, value in view.items():
            if fqn in out:
                assert_deep_equal(out[fqn], value, f"{fqn} on two ranks", nan_equal="none")
            out[fqn] = value
    return dict(sorted(out.items()))


def assert_matches(view: dict[str, Any], reference: dict[str, Any], where: str) -> None:
    """Every parameter of ``view`` has exactly the reference's full value, state and settings."""
    for fqn, value in view.items():
        assert fqn in reference, f"{where}: {fqn} is not in the reference"
        assert_deep_equal(value, reference[fqn], f"{where}: {fqn}", nan_equal="none", check_order=False)
