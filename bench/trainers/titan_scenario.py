"""The torchtitan scenario shared by tests/integrations/test_torchtitan*.py and bench/trainers/titan_compare.py.

A small MoE-ish model (``layers.{i}.router`` and ``layers.{i}.experts.{e}``, plus ``aux``, a
``Linear`` used only when asked), built with torchtitan's own ``OptimizersContainer.Config``
(leaf ``optim0``: an ``Adam`` over ``aux`` that never steps before the save; ``optim1``: ``AdamW``
over everything else) and ``LRSchedulersContainer.Config`` (linear warmup, so every step moves
every group's lr, the never-stepped ``aux`` group's too). :func:`train` routes tokens only to the
experts it is given, so the others get no gradient and no state. Needs torchtitan: import this
module only after ``pytest.importorskip("torchtitan")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.fsdp import fully_shard
from torchtitan.components.checkpoint import MODEL, CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

from sparse_ckpt._leaves import named_leaves

DIM = 8
LAYERS = 2
EXPERTS = 4
ROUTED_BEFORE = (0, 2)
"""The experts :func:`train` routes to before the save: experts 1 and 3 of every layer get no tokens."""
ROUTED_AFTER = tuple(range(EXPERTS))
"""After the resume every expert gets tokens (the first step of experts 1 and 3 creates their state)."""
LR = 0.01
WARMUP = 4


class MoELayer(nn.Module):
    """A router and ``experts`` ``Linear`` experts; only the experts in ``routed`` see tokens."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor, routed: Sequence[int]) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        out = x
        for e in routed:
            out = out + gates[:, e : e + 1] * self.experts[e](x)
        return torch.tanh(out)


class TitanMoE(nn.Module):
    """``layers`` MoE layers and ``aux`` (a ``Linear`` applied only when ``use_aux``)."""

    def __init__(self, dim: int = DIM, layers: int = LAYERS, experts: int = EXPERTS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(dim, experts) for _ in range(layers))
        self.aux = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, routed: Sequence[int], use_aux: bool) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, routed)
        return self.aux(x) if use_aux else x


def build(
    seed: int, mesh: Any = None, device: str | torch.device | None = None, **shape: int
) -> tuple[TitanMoE, OptimizersContainer, LRSchedulersContainer]:
    """The model (on ``device`` when given; each layer and the root ``fully_shard``-ed on ``mesh``
    when given), torchtitan's ``OptimizersContainer`` (``optim0``: Adam over ``aux``; ``optim1``:
    AdamW over the rest; the for-loop implementation, as on CPU) and its ``LRSchedulersContainer``."""
    torch.manual_seed(seed)
    model = TitanMoE(**shape)
    if device is not None:
        model.to(device)
    if mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=r"^aux\.", optimizer_name="Adam", optimizer_kwargs={"lr": LR}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": LR, "weight_decay": 0.1}),
        ],
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=WARMUP, total_steps=100).build(
        optimizers=optimizers, training_steps=100
    )
    return model, optimizers, schedulers


def routed_experts(experts: int, fraction: float) -> tuple[int, ...]:
    """Every ``round(1 / fraction)``-th expert (all of them for 1.0): the experts that get tokens."""
    if fraction >= 1.0:
        return tuple(range(experts))
    stride = max(1, round(1 / fraction))
    return tuple(range(0, experts, stride))


def train(
    model: TitanMoE,
    optimizers: OptimizersContainer,
    schedulers: LRSchedulersContainer,
    steps: range,
    routed: Sequence[int],
    use_aux: bool,
    rank: int = 0,
) -> None:
    """One deterministic step per number in ``steps`` (the batch depends on the step and the rank)."""
    for step in steps:
        optimizers.zero_grad()
        x = torch.randn(4, model.aux.in_features, generator=torch.Generator().manual_seed(1000 * step + rank))
        x = x.to(model.aux.weight.device)
        model(x, routed, use_aux).pow(2).mean().backward()
        optimizers.step()
        schedulers.step()


class Counter:
    """A DCP Stateful holding one int under ``key``: what torchtitan's trainer saves as ``train_state``
    (``Counter("step")``) and a stand-in for its dataloader entry (``Counter("position")``)."""

    def __init__(self, key: str, value: int = 0) -> None:
        self.key = key
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = int(sd[self.key])


def TrainState(step: int = 0) -> Counter:
    """The ``train_state`` entry: ``Counter("step", step)``."""
    return Counter("step", step)


def Loader(position: int = 0) -> Counter:
    """The ``dataloader`` entry: ``Counter("position", position)``."""
    return Counter("position", position)


def manager(
    config_cls: Any,
    base_folder: str,
    model: nn.Module,
    optimizers: Any,
    schedulers: Any,
    train_state: Counter,
    loader: Counter | None = None,
    **config: Any,
) -> Any:
    """``config_cls(enable=True, interval=1, ...)`` built the way torchtitan's trainer builds its manager."""
    fields = {"enable": True, "interval": 1, "keep_latest_k": 0, **config}
    return config_cls(**fields).build(
        dataloader=loader if loader is not None else Loader(),
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=base_folder,
    )


def leaves(optimizers: OptimizersContainer) -> dict[str, torch.optim.Optimizer]:
    """The container's optimizers by sparse_ckpt's leaf names (``optim0``, ``optim1``, ...)."""
    return dict(named_leaves(optimizers))


def lrs(optimizers: OptimizersContainer) -> list[float]:
    """Every group's lr, leaf by leaf."""
    return [float(g["lr"]) for o in optimizers.optimizers for g in o.param_groups]


class PartialLoadManager(CheckpointManager):
    """torchtitan's stock manager loading with ``allow_partial_load=True`` (what a user tries when the
    stock load fails with ``Missing key in checkpoint state_dict``); saves exactly as the stock one."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=DefaultLoadPlanner(allow_partial_load=True))
        self.states[MODEL].load_state_dict(state_dict)
