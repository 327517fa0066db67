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

from drill_outcome import record
from hf_cpu_fsdp2 import moe_trainer
from transformers import HfArgumentParser, Trainer, TrainingArguments


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    trainer = moe_trainer(Trainer, args)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    record(
        os.path.join(args.output_dir, "outcome.pt"),
        trainer.model,
        trainer.optimizer.optimizer,
        trainer.lr_scheduler.get_last_lr(),
    )


if __name__ == "__main__":
    main()
