"""The Hugging Face ``Trainer`` drills' shared runs: what a run ends with, the uninterrupted run and the
resumed runs (the Trainer itself on FSDP2 over a CPU mesh: :mod:`hf_cpu_fsdp2`).

The runs (:func:`uninterrupted`, :func:`resumed`) train :data:`STEPS` steps with a checkpoint after
step :data:`SAVE_AT` through the Trainer's own checkpointing; each takes a ``make_trainer(output_dir)``
of the calling test module (module-level, so that ``functools.partial`` of it pickles to the ranks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import dsd_moe
import pytest
import torch
from _dist import full_copy
from helpers import assert_deep_equal

STEPS = 5
SAVE_AT = 3
TRAINING_ARGS: dict[str, Any] = {
    "max_steps": STEPS,
    "save_strategy": "steps",
    "save_steps": SAVE_AT,
    "per_device_train_batch_size": 2,
    "use_cpu": True,
    "report_to": "none",
    "seed": 0,
    "disable_tqdm": True,
    "logging_strategy": "no",
    "dataloader_num_workers": 0,
}
"""The drills' ``TrainingArguments``/``SFTConfig`` settings but ``output_dir``: :data:`STEPS` steps, a
checkpoint after step :data:`SAVE_AT`, 2 samples a rank, CPU, seeded, quiet."""


def outcome(t: Any) -> dict[str, Any]:
    """Full parameters, lrs and the number of parameters with optimizer state (a collective)."""
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in t.model.parameters())  # FSDP2 is in effect
    opt = t.optimizer.optimizer if hasattr(t.optimizer, "optimizer") else t.optimizer
    return {
        "params": {n: full_copy(p) for n, p in t.model.named_parameters()},
        "lrs": [g["lr"] for g in opt.param_groups],
        "scheduler_lrs": list(t.lr_scheduler.get_last_lr()),
        "with_state": len(opt.state),
    }


def uninterrupted(make_trainer: Callable[[str], Any], rank: int, world_size: int, root: str) -> None:
    """Fresh processes: the stock run (its ``checkpoint-3``), then the installed run (its own)."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    t = make_trainer(f"{root}/stock")
    assert len(list(t.model.parameters())) == dsd_moe.PARAMS
    t.train()
    reference = outcome(t)
    assert reference["with_state"] == dsd_moe.STEPPED
    if rank == 0:
        torch.save(reference, f"{root}/uninterrupted.pt")

    import sparse_ckpt.integrations.dsd as sc_dsd  # after the trainer's imports: the usual order

    sc_dsd.install()
    t = make_trainer(f"{root}/sparse")
    t.train()
    assert_deep_equal(outcome(t), reference, "installed run", nan_equal="none")


def resumed(make_trainer: Callable[[str], Any], stock_error: str, rank: int, world_size: int, root: str) -> None:
    """Fresh processes: the stock resume fails with ``stock_error`` after DSD's synthetic step put state
    on every parameter; with ``install()`` both checkpoints resume exactly, the parameters that stepped
    with state, the lrs the scheduler's."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from torch.distributed.checkpoint.api import CheckpointException

    reference = torch.load(f"{root}/uninterrupted.pt", weights_only=False)
    t = make_trainer(f"{root}/resume-stock")
    with pytest.raises(CheckpointException, match=stock_error):
        t.train(resume_from_checkpoint=f"{root}/stock/checkpoint-{SAVE_AT}")
    assert len(t.optimizer.optimizer.state) == dsd_moe.PARAMS  # DSD's synthetic step: 18 invented

    import sparse_ckpt.integrations.dsd as sc_dsd

    sc_dsd.install()
    for source in ("stock", "sparse"):
        t = make_trainer(f"{root}/resume-{source}")
        t.train(resume_from_checkpoint=f"{root}/{source}/checkpoint-{SAVE_AT}")
        got = outcome(t)
        assert got["with_state"] == dsd_moe.STEPPED, source
        assert got["lrs"] == got["scheduler_lrs"] == reference["lrs"], source
        assert_deep_equal(got, reference, f"resumed from the {source} checkpoint", nan_equal="none")
