"""The small MoE (unrouted experts, a tower that never steps) of the torch DSD tests and the trainer drills.

2 layers, each a router and 8 ``nn.Linear`` experts of which only 0-3 are ever routed (a dense
softmax mixture over them), a ``vision`` tower that never runs, and a head: 40 parameters, 22 of
them with gradients (2 routers, 8 routed experts, the head, weight and bias each). :func:`optimizer`
puts ``vision`` in its own AdamW param group and :func:`scheduler` moves that group's lr every
step (a different factor per group), so a resume that loses ``vision``'s lr shows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

DIM = 8
EXPERTS = 8
ROUTED = 4
PARAMS = 40
STEPPED = 22
VISION_LR = 0.02


class MoeLayer(nn.Module):
    """A router and :data:`EXPERTS` experts; only the first :data:`ROUTED` are ever used."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x)[:, :ROUTED], dim=-1)
        return x + sum(gates[:, i : i + 1] * torch.tanh(self.experts[i](x)) for i in range(ROUTED))


class Moe(nn.Module):
    """Two :class:`MoeLayer`, an unused ``vision`` tower and a head; ``forward(x, labels)`` returns
    ``{"loss": ...}`` (the form Hugging Face ``Trainer`` reads) when ``labels`` is given."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoeLayer() for _ in range(2))
        self.vision = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        for layer in self.layers:
            x = layer(x)
        out = self.head(x).squeeze(-1)
        if labels is None:
            return out
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


def model(seed: int = 0) -> Moe:
    torch.manual_seed(seed)
    return Moe()


def param_groups(m: nn.Module) -> list[dict[str, Any]]:
    """Two groups: everything but ``vision`` (lr 0.01), and ``vision`` (lr :data:`VISION_LR`)."""
    vision = [p for n, p in m.named_parameters() if n.startswith("vision.")]
    rest = [p for n, p in m.named_parameters() if not n.startswith("vision.")]
    return [{"params": rest, "lr": 0.01}, {"params": vision, "lr": VISION_LR}]


def optimizer(m: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(m), lr=0.01)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Group 0 decays by 0.9 per step, ``vision``'s by 0.5: both lrs move every step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.9**s, lambda s: 0.5**s])


def batch(step: int, rank: int = 0, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for ``step`` on ``rank``."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, DIM, generator=gen), torch.randn(n, generator=gen)


def train(m: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: range, rank: int = 0) -> None:
    """One optimizer step per ``steps`` entry on :func:`batch` (gradients set to ``None`` after)."""
    for step in steps:
        x, y = batch(step, rank)
        m(x, y)["loss"].backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
