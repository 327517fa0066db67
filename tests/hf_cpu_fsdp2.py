"""FSDP2 on a CPU mesh for a Hugging Face ``Trainer``: user code, not sparse_ckpt.

``Trainer`` runs FSDP only on accelerator devices (accelerate picks ``MULTI_CPU``, i.e. DDP, on CPU);
:func:`cpu_fsdp2` applies the CPU recipe of docs/integrations/hugging-face.md ("Accelerate") to the
accelerator a ``Trainer`` (or a subclass such as TRL's ``SFTTrainer``) creates, and builds the drill's
optimizer and LambdaLR with ``create_optimizer``/``create_scheduler`` (Trainer's documented hooks).
It imports nothing of sparse_ckpt: the launcher drill's training script, which must reach sparse_ckpt
through the launcher alone, uses it as the test drills do. :func:`moe_trainer`: the drill MoE's
``Trainer`` on :class:`Batches` (one optimizer step per epoch on 2 ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dsd_moe
import torch
import torch.distributed as dist
from torch import nn


def cpu_fsdp2(base: type, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> type:
    """``base`` (a ``transformers.Trainer`` class) with FSDP2 over a CPU mesh of all ranks, the optimizer
    ``make_optimizer(model)`` and the drill's LambdaLR (:func:`dsd_moe.scheduler`)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig

    class CpuFsdp2(base):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            for s in (state, PartialState()):
                s.distributed_type = DistributedType.FSDP
            config = ParallelismConfig(dp_shard_size=dist.get_world_size())
            state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
            state.parallelism_config = config
            state.device_mesh = config.get_device_mesh("cpu")
            self.is_fsdp_enabled = True

        def create_optimizer(self, model: Any = None) -> Any:
            if self.optimizer is None:
                self.optimizer = make_optimizer(self.model)
            return self.optimizer

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                self.lr_scheduler = dsd_moe.scheduler(optimizer or self.optimizer)
            return self.lr_scheduler

    CpuFsdp2.__name__ = CpuFsdp2.__qualname__ = f"CpuFsdp2{base.__name__}"
    return CpuFsdp2


class Batches(torch.utils.data.Dataset):
    """One optimizer step per epoch on 2 ranks (4 samples, 2 per rank)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = dsd_moe.batch(0, i, n=1)
        return {"x": x[0], "labels": y[0]}


def moe_trainer(base: type, args: Any) -> Any:
    """A ``base`` (``transformers.Trainer``) on a fresh drill MoE (seed 0) and :class:`Batches`, FSDP2 on CPU,
    :func:`dsd_moe.optimizer` (AdamW, two groups) and LambdaLR: the HF ``Trainer`` drills' trainer."""
    return cpu_fsdp2(base, dsd_moe.optimizer)(model=dsd_moe.model(0), args=args, train_dataset=Batches())
