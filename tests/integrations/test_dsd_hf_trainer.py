"""Hugging Face ``Trainer`` (transformers + accelerate, FSDP2) resumed exactly by ``integrations.dsd``.

The trainer drill (:mod:`trainer_drill`'s MoE and checks) with the real packages: 2 Gloo ranks, FSDP2 over a CPU mesh, the MoE of
:mod:`dsd_moe` (40 parameters, 22 with gradients, ``vision`` in its own AdamW group whose lr a
LambdaLR moves), trained for 5 steps with a checkpoint after step 3 through ``Trainer``'s own
checkpointing (``save_steps=3``: ``_save_checkpoint`` -> accelerate's ``save_fsdp_optimizer`` ->
DSD's ``get_optimizer_state_dict`` + ``dcp.save``), and resumed in fresh processes with
``trainer.train(resume_from_checkpoint=...)``:

- stock (pinned): the resume fails with ``Missing key in checkpoint state_dict:
  optimizer.state.layers.0.experts.4.weight.step`` after DSD's synthetic step put state on all
  40 parameters of the fresh optimizer;
- with ``sparse_ckpt.integrations.dsd.install()`` called *after* ``from transformers import
  Trainer`` (which binds accelerate's ``save_fsdp_optimizer``/``load_fsdp_optimizer``): the stock
  checkpoint and the installed run's own checkpoint both resume, the next two steps equal the
  uninterrupted run bit for bit, the optimizer holds state for the 22 parameters that stepped, and
  ``vision``'s lr is the scheduler's.

Trainer runs FSDP only on accelerator devices (accelerate picks ``MULTI_CPU``, i.e. DDP, on CPU);
:class:`CpuFsdp2Trainer` applies the CPU recipe of docs/integrations/hugging-face.md ("Accelerate") to the
accelerator the Trainer creates, and builds the optimizer and scheduler the drill needs with
``create_optimizer``/``create_scheduler`` (Trainer's documented hooks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install --no-deps -r .ci/requirements-accelerate.txt)")
pytest.importorskip("transformers", reason="transformers is not installed (pip install --no-deps -r .ci/requirements-veomni.txt: transformers 5.9.0 and its imports)")

import _backends
import dsd_moe
import torch
import torch.distributed as dist
from _dist import full_copy, run_ranks
from helpers import assert_deep_equal

pytestmark = [
    pytest.mark.usefixtures("forbid_fork"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
]

STEPS = 5
SAVE_AT = 3


class Batches(torch.utils.data.Dataset):
    """One optimizer step per epoch on 2 ranks (4 samples, 2 per rank)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = dsd_moe.batch(0, i, n=1)
        return {"x": x[0], "labels": y[0]}


def trainer(output_dir: str) -> Any:
    """A fresh Trainer on a fresh MoE (seed 0), FSDP2 on CPU, AdamW (two groups) and LambdaLR."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ParallelismConfig
    from transformers import Trainer, TrainingArguments

    class CpuFsdp2Trainer(Trainer):
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

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_AT,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        seed=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        logging_strategy="no",
        dataloader_num_workers=0,
    )
    return CpuFsdp2Trainer(model=dsd_moe.model(0), args=args, train_dataset=Batches())


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


def uninterrupted(rank: int, world_size: int, root: str) -> None:
    """Fresh processes: the stock run (its checkpoint-3), then the installed run (its own checkpoint-3)."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    t = trainer(f"{root}/stock")
    t.train()
    reference = outcome(t)
    assert reference["with_state"] == dsd_moe.STEPPED
    if rank == 0:
        torch.save(reference, f"{root}/uninterrupted.pt")

    import sparse_ckpt.integrations.dsd as sc_dsd  # after the trainer's imports: the usual order

    sc_dsd.install()
    t = trainer(f"{root}/sparse")
    t.train()
    assert_deep_equal(outcome(t), reference, "installed run", nan_equal="none")


def resumed(rank: int, world_size: int, root: str) -> None:
    """Fresh processes: the stock resume fails (pinned); with install() both checkpoints resume exactly."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from torch.distributed.checkpoint.api import CheckpointException

    reference = torch.load(f"{root}/uninterrupted.pt", weights_only=False)
    t = trainer(f"{root}/resume-stock")
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optimizer\.state\.layers\.0\.experts\.4\.weight\.step"):
        t.train(resume_from_checkpoint=f"{root}/stock/checkpoint-{SAVE_AT}")
    assert len(t.optimizer.optimizer.state) == dsd_moe.PARAMS  # DSD's synthetic step: 18 invented

    import sparse_ckpt.integrations.dsd as sc_dsd

    sc_dsd.install()
    for source in ("stock", "sparse"):
        t = trainer(f"{root}/resume-{source}")
        t.train(resume_from_checkpoint=f"{root}/{source}/checkpoint-{SAVE_AT}")
        got = outcome(t)
        assert got["with_state"] == dsd_moe.STEPPED, source
        assert got["lrs"] == got["scheduler_lrs"] == reference["lrs"], source
        assert_deep_equal(got, reference, f"resumed from the {source} checkpoint", nan_equal="none")


def checkpoint_size(path: Path) -> dict[str, int]:
    """Items under ``optimizer`` and bytes of an ``optimizer_0`` DCP directory."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    items = sum(1 for k in metadata.state_dict_metadata if k.startswith("optimizer."))
    return {"items": items, "bytes": sum(f.stat().st_size for f in path.iterdir())}


@_backends.only(_backends.DEFAULT)
def test_hf_trainer_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    run_ranks(uninterrupted, 2, str(tmp_path), timeout=300)
    sizes = {s: checkpoint_size(tmp_path / s / f"checkpoint-{SAVE_AT}" / "optimizer_0") for s in ("stock", "sparse")}
    # a stepped optimizer: the same entries, and the key record (docs/formats.md, *Key record*)
    assert sizes["stock"]["items"] + 1 == sizes["sparse"]["items"], sizes
    run_ranks(resumed, 2, str(tmp_path), timeout=300)
    print(json.dumps(sizes))


def test_accelerate_install_reaches_transformers_trainer_imported_before() -> None:
    """``transformers.trainer`` binds accelerate's ``save_fsdp_optimizer``/``load_fsdp_optimizer`` when it
    is imported; ``integrations.accelerate.install()`` afterwards replaces those names too, and
    ``uninstall()`` puts accelerate's own back."""
    import transformers.trainer as hf_trainer
    from accelerate.utils import fsdp_utils

    from sparse_ckpt.integrations import accelerate as integration

    assert hf_trainer.save_fsdp_optimizer is fsdp_utils.save_fsdp_optimizer  # bound at import
    integration.install()
    try:
        assert hf_trainer.save_fsdp_optimizer is integration.save_fsdp_optimizer
        assert hf_trainer.load_fsdp_optimizer is integration.load_fsdp_optimizer
    finally:
        integration.uninstall()
    assert hf_trainer.save_fsdp_optimizer is fsdp_utils.save_fsdp_optimizer
    assert hf_trainer.load_fsdp_optimizer is fsdp_utils.load_fsdp_optimizer
