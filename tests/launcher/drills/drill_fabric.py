"""A Lightning Fabric script (``ModelParallelStrategy``, FSDP2) as ``torchrun`` runs it; no sparse_ckpt line.

``python fabric.py CKPT OUT [--resume]``: the MoE of ``dsd_moe`` on the strategy's CPU mesh, AdamW
over two groups and a LambdaLR. A fresh run trains ``STEPS`` steps and saves with ``fabric.save``
(DCP) into CKPT after ``SAVE_AT``; ``--resume`` loads CKPT with ``fabric.load`` and trains the
remaining steps. Either way ``drill_outcome.record`` goes to OUT.
"""

from __future__ import annotations

import sys

import dsd_moe
import lightning as L
from drill_outcome import SAVE_AT, STEPS, record
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard


def parallelize(model, mesh):
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def main(ckpt: str, out: str, resume: bool) -> None:
    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(dsd_moe.model(0))
    optimizer = fabric.setup_optimizers(dsd_moe.optimizer(model))
    scheduler = dsd_moe.scheduler(optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    first = 0
    if resume:
        fabric.load(ckpt, state)
        if state["scheduler"] is not scheduler:  # Fabric's DCP load hands a plain object's state back
            scheduler.load_state_dict(state["scheduler"])
        first = SAVE_AT
    for step in range(first, STEPS):
        x, y = dsd_moe.batch(step, fabric.global_rank)
        fabric.backward(model(x, y)["loss"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == SAVE_AT and not resume:
            fabric.save(ckpt, {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    record(out, model.module, optimizer.optimizer, scheduler.get_last_lr())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--resume" in sys.argv[3:])
