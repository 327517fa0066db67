"""A Hugging Face ``Trainer`` script configured by its command line, as ``accelerate launch`` runs it.

The training script of a user who cannot (or will not) change it: no line of sparse_ckpt. Its
``TrainingArguments`` come from the command line (``HfArgumentParser``), ``--resume_from_checkpoint``
included. The model is the MoE of ``dsd_moe`` (40 parameters, 22 with gradients, ``vision`` in its
own AdamW group whose lr a LambdaLR moves); FSDP2 over a CPU mesh, because ``Trainer`` runs FSDP
only on accelerator devices (the recipe of docs/integrations.md, "Accelerate": user code, not
sparse_ckpt). At the end it writes ``drill_outcome.record`` to ``{output_dir}/outcome.pt``.
"""

from __future__ import annotations

import os
from typing import Any

import dsd_moe
import torch
import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig
from drill_outcome import record
from transformers import HfArgumentParser, Trainer, TrainingArguments


class Batches(torch.utils.data.Dataset):
    """One optimizer step per epoch on 2 ranks (4 samples, 2 per rank)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = dsd_moe.batch(0, i, n=1)
        return {"x": x[0], "labels": y[0]}


class CpuFsdp2Trainer(Trainer):
    """``Trainer`` with FSDP2 on CPU, AdamW over two groups and a LambdaLR."""

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
            self.optimizer = dsd_moe.optimizer(self.model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = dsd_moe.scheduler(optimizer or self.optimizer)
        return self.lr_scheduler


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    trainer = CpuFsdp2Trainer(model=dsd_moe.model(0), args=args, train_dataset=Batches())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    record(os.path.join(args.output_dir, "outcome.pt"), trainer.model, trainer.optimizer.optimizer, trainer.lr_scheduler.get_last_lr())


if __name__ == "__main__":
    main()
