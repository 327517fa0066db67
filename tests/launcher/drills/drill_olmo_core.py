"""An OLMo-core script as ``torchrun`` runs it (``save_model_and_optim_state`` /
``load_model_and_optim_state``, DSD's flat layout); no sparse_ckpt line.

``python olmo_core.py CKPT OUT [--resume]``: the MoE of ``dsd_moe``, FSDP2 over a CPU mesh (each MoE
layer, then the root), AdamW over two groups and a LambdaLR. A fresh run trains ``STEPS`` steps and
saves into CKPT after ``SAVE_AT`` (the scheduler beside it, one file per rank: the API saves model
and optimizer only); ``--resume`` loads CKPT and trains the remaining steps. Either way
``drill_outcome.record`` goes to OUT.
"""

from __future__ import annotations

import sys

import dsd_moe
import torch
import torch.distributed as dist
from drill_outcome import SAVE_AT, STEPS, record
from olmo_core.distributed.checkpoint import load_model_and_optim_state, save_model_and_optim_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main(ckpt: str, out: str, resume: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = dsd_moe.model(0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dsd_moe.optimizer(model)
    scheduler = dsd_moe.scheduler(optimizer)
    scheduler_file = f"{ckpt}-scheduler-rank{rank}.pt"
    first = 0
    if resume:
        load_model_and_optim_state(ckpt, model, optimizer, flatten_optimizer_state=True)
        scheduler.load_state_dict(torch.load(scheduler_file, weights_only=False))
        first = SAVE_AT
    for step in range(first, STEPS):
        dsd_moe.train(model, optimizer, scheduler, range(step, step + 1), rank)
        if step + 1 == SAVE_AT and not resume:
            save_model_and_optim_state(ckpt, model, optimizer, flatten_optimizer_state=True)
            torch.save(scheduler.state_dict(), scheduler_file)
    record(out, model, optimizer, scheduler.get_last_lr())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--resume" in sys.argv[3:])
