"""torchtune 0.6.1's FSDP2 recipe checkpointing, driven as ``recipes/full_finetune_distributed.py`` drives it.

Shared by tests/integrations/test_torchtune.py and ``python -m bench.tune_compare``. No recipe
config and no hub download: the functions below call what the recipe calls, with a config that has
only the entries ``CheckpointClient`` reads, on any FSDP2 model and optimizer the caller builds.
The recipe lines mirrored (torchtune 0.6.1, ``recipes/full_finetune_distributed.py``):

- ``__init__``: ``self._checkpoint_client = CheckpointClient(cfg)`` (`client`);
- ``setup``: ``checkpoint_dict = self._checkpoint_client.load_base_checkpoint()``, then
  ``_setup_model`` -> ``training.load_from_full_model_state_dict(model, model_state_dict, device,
  strict=True, cpu_offload=...)``, then ``_setup_optimizer`` -> ``training.load_from_full_optimizer_state_dict(
  model, optimizer, opt_state_dict, device)`` when the checkpoint has ``training.OPT_KEY``, then, with
  ``enable_async_checkpointing``, ``self._checkpoint_client.load_distributed_checkpoint(model,
  optimizer)`` (the recipe catches its exception and trains on from the base checkpoint; here it
  propagates) (`resume`);
- ``train``: at the end of each epoch ``self._checkpoint_client.save_checkpoint(model=...,
  optimizer=..., training_progress=TrainingProgress(...), epoch=curr_epoch)`` (`save`; epoch 0 of
  2, so an intermediate checkpoint with the optimizer). An async save is waited for before `save`
  returns (the recipe waits at its next save).

The learning-rate scheduler is not in torchtune's checkpoints: the recipe rebuilds it with
``last_epoch=global_step - 1`` from the optimizer's ``initial_lr`` and ``lr``, which the load restores.
Needs torchtune (``pip install --no-deps -r .ci/requirements-torchtune.txt``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torchtune import training
from torchtune.training.checkpointing._checkpoint_client import CheckpointClient, TrainingProgress

SHARD = "model-00001-of-00001.bin"
"""The model file ``FullModelTorchTuneCheckpointer`` writes into ``epoch_N``."""
BASE = "base.pt"
"""The base weights a run starts from (what a hub download would put in ``checkpoint_dir``)."""
EPOCH = 0
TOTAL_EPOCHS = 2
SEED = 1234


def config(root: str | Path, *, async_: bool, resume: bool) -> Any:
    """The part of a recipe config ``CheckpointClient`` reads: ``checkpoint_dir`` holds :data:`BASE`,
    ``output_dir`` the run's checkpoints; a resume of a sync run reads ``epoch_0`` of ``output_dir``."""
    root = Path(root)
    files = [f"epoch_{EPOCH}/{SHARD}"] if resume and not async_ else [BASE]
    return OmegaConf.create(
        {
            "device": "cpu",
            "resume_from_checkpoint": resume,
            "enable_async_checkpointing": async_,
            "optimizer_in_bwd": False,
            "checkpointer": {
                "_component_": "torchtune.training.FullModelTorchTuneCheckpointer",
                "checkpoint_dir": str(root / "base"),
                "checkpoint_files": files,
                "output_dir": str(root / "out"),
                "model_type": "LLAMA3",
            },
        }
    )


def write_base(root: str | Path, model: torch.nn.Module) -> None:
    """Rank 0 writes ``model``'s full weights as the run's base checkpoint (a plain, unsharded model)."""
    base = Path(root) / "base"
    if dist.get_rank() == 0:
        base.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), base / BASE)
    dist.barrier()


def client(root: str | Path, *, async_: bool, resume: bool) -> CheckpointClient:
    """The recipe's ``CheckpointClient(cfg)``."""
    return CheckpointClient(config(root, async_=async_, resume=resume))


def save(
    root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, async_: bool
) -> CheckpointClient:
    """The recipe's end-of-epoch save (epoch 0 of 2: model, optimizer and training progress)."""
    ckpt = client(root, async_=async_, resume=False)
    progress = TrainingProgress(seed=SEED, epochs_run=EPOCH + 1, total_epochs=TOTAL_EPOCHS, max_steps_per_epoch=3)
    ckpt.save_checkpoint(model=model, optimizer=optimizer, training_progress=progress, epoch=EPOCH)
    wait(ckpt)
    return ckpt


def wait(ckpt: CheckpointClient) -> None:
    """Wait for an async save to be on disk on every rank."""
    dcp_ckpt = ckpt._dcp_checkpointer
    if dcp_ckpt is not None and dcp_ckpt._checkpoint_future is not None:
        dcp_ckpt._checkpoint_future.result()
        dcp_ckpt._checkpoint_future = None
    dist.barrier()


def resume(
    root: str | Path, model: torch.nn.Module, make_optimizer: Callable[[torch.nn.Module], Any], *, async_: bool
) -> tuple[Any, dict[str, Any]]:
    """The recipe's ``setup`` on ``resume_from_checkpoint: True``: base (or ``epoch_0``) weights into the
    sharded ``model`` (torchtune assigns new parameters), then ``make_optimizer(model)`` (the recipe's
    ``config.instantiate(cfg_optimizer, model.parameters())``) and the sync optimizer state into it,
    then with ``async_`` the distributed checkpoint. Returns the optimizer and the checkpoint dict the
    recipe updates its state from."""
    ckpt = client(root, async_=async_, resume=True)
    device = torch.device("cpu")
    checkpoint_dict = ckpt.load_base_checkpoint()
    training.load_from_full_model_state_dict(model, checkpoint_dict[training.MODEL_KEY], device, strict=True)
    optimizer = make_optimizer(model)
    if checkpoint_dict.get(training.OPT_KEY):
        training.load_from_full_optimizer_state_dict(model, optimizer, checkpoint_dict[training.OPT_KEY], device)
    if async_:
        checkpoint_dict = ckpt.load_distributed_checkpoint(model, optimizer)
    return optimizer, checkpoint_dict


__all__ = ["BASE", "SHARD", "client", "config", "resume", "save", "wait", "write_base"]
