"""What the launcher drills record at the end of a run (plain torch: the drills have no sparse_ckpt line).

:func:`record` is a collective (DTensors are gathered with ``full_tensor``): every rank calls it at the
same point; rank 0 writes the result with ``torch.save``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SAVE_AT = 3
"""The drills save after this many optimizer steps (and resume from there)."""
STEPS = 5
"""Every run ends after this many optimizer steps."""


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def record(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler_lrs: list[float]) -> None:
    """Full parameters, optimizer state by FQN, group lrs, the scheduler's last lrs and the number
    of parameters with state, written by rank 0 to ``path``."""
    names = list(model.named_parameters())
    result = {
        "params": {n: _full(p) for n, p in names},
        "state": {
            n: {k: _full(v) for k, v in sorted(optimizer.state[p].items())} for n, p in names if p in optimizer.state
        },
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "scheduler_lrs": [float(lr) for lr in scheduler_lrs],
        "with_state": len(optimizer.state),
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, path)
    if dist.is_initialized():
        dist.barrier()
