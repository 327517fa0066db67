"""A Hugging Face ``Trainer`` script configured by its command line, as ``accelerate launch`` runs it.

The training script of a user who cannot (or will not) change it: no line of sparse_ckpt. Its
``TrainingArguments`` come from the command line (``HfArgumentParser``), ``--resume_from_checkpoint``
included. The model is the MoE of ``dsd_moe`` (40 parameters, 22 with gradients, ``vision`` in its
own AdamW group whose lr a LambdaLR moves); FSDP2 over a CPU mesh, because ``Trainer`` runs FSDP
only on accelerator devices (the recipe of docs/integrations/hugging-face.md, "Accelerate": user
code, not sparse_ckpt; :mod:`hf_cpu_fsdp2`). At the end it writes ``drill_outcome.record`` to
``{output_dir}/outcome.pt``.
"""

from __future__ import annotations

import os

import dsd_moe
import torch
from drill_outcome import record
from hf_cpu_fsdp2 import cpu_fsdp2
from transformers import HfArgumentParser, Trainer, TrainingArguments


class Batches(torch.utils.data.Dataset):
    """One optimizer step per epoch on 2 ranks (4 samples, 2 per rank)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = dsd_moe.batch(0, i, n=1)
        return {"x": x[0], "labels": y[0]}


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    trainer = cpu_fsdp2(Trainer, dsd_moe.optimizer)(model=dsd_moe.model(0), args=args, train_dataset=Batches())
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    record(
        os.path.join(args.output_dir, "outcome.pt"),
        trainer.model,
        trainer.optimizer.optimizer,
        trainer.lr_scheduler.get_last_lr(),
    )


if __name__ == "__main__":
    main()
