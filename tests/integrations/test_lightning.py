"""Lightning (2.6.6) Fabric and Trainer with ``ModelParallelStrategy``, resumed exactly by ``integrations.dsd``.

The trainer drill (:mod:`trainer_drill`) with the real package: 2 Gloo ranks, FSDP2 over the
strategy's CPU mesh (``parallelize_fn``/``configure_model`` shard over ``device_mesh["data_parallel"]``),
the MoE of :mod:`dsd_moe`, a checkpoint after step 3 through Lightning's own API, a resume in a
fresh set of processes, two more steps, compared with the uninterrupted run. Both checkpoint kinds
of the strategy: ``save_distributed_checkpoint=True`` (DCP, the default) and ``False`` (one file,
full state dicts, ``torch.save``).

- Stock (pinned): the DCP resume fails with ``Missing key in checkpoint state_dict:
  optimizer.state.layers.0.experts.4.weight.step`` (Trainer: ``optimizer_0.state.moe.``...), the
  one-file resume with DSD's strict check (``Missing optimizer state for parameter
  'layers.0.experts.4.weight' in checkpoint``); either way DSD's synthetic step has put state on
  all 40 parameters of the fresh optimizer (18 invented) and the lrs are the fresh ones.
- With ``sparse_ckpt.integrations.dsd.install()`` called after Lightning's imports (the blocks
  of docs/integrations/lightning.md, "Lightning Fabric" and "Lightning Trainer", run as written: they install
  and define the ``save``/``resume`` the installed runs call): the stock checkpoints and the
  installed runs' own resume, the next steps equal the uninterrupted run bit for bit, state for the
  22 parameters that stepped, ``vision``'s lr the scheduler's.

Lightning is told about the ranks the drill starts through the torchrun variables
(``LOCAL_RANK``...: ``creates_processes_externally``) and reuses their process group.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lightning", reason="lightning is not installed (pip install --no-deps -r .ci/requirements-lightning.txt)"
)

import _backends
import dsd_moe
import torch
import trainer_drill as drill
from _dist import run_ranks
from doc_blocks import ROOT, run_block

pytestmark = drill.MARKS

KINDS = {"dcp": True, "file": False}
"""Checkpoint kind -> ``save_distributed_checkpoint``."""
STOCK_ERRORS = {
    "dcp": r"Missing key in checkpoint state_dict: {prefix}\.state\.{fqn}\.step",  # DCP's planner
    "file": r"Missing optimizer state for parameter '{fqn}' in checkpoint",  # DSD's strict check
}
PAGE = ROOT / "docs/integrations/lightning.md"
"""The trainer's page, whose blocks this drill runs as written."""
UNROUTED = "layers.0.experts.4.weight"
FABRIC_BLOCK = "fabric.save(path"
TRAINER_BLOCK = "trainer.save_checkpoint(path)"


def installed(marker: str) -> dict[str, Any]:
    """Run the docs block containing ``marker`` (it calls ``install()``); its names."""
    names = run_block(drill.doc_block(PAGE, marker), {"__name__": "docs"})
    assert names["sc_dsd"].installed()
    return names


def _quiet() -> None:
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)


def stock_error(kind: str, prefix: str, fqn: str) -> tuple[type[BaseException], str]:
    """The exception and message of a stock resume from a checkpoint of ``kind``."""
    from torch.distributed.checkpoint.api import CheckpointException

    pattern = STOCK_ERRORS[kind].format(prefix=re.escape(prefix), fqn=re.escape(fqn))
    return (CheckpointException if kind == "dcp" else RuntimeError), pattern


# --------------------------------------------------------------------------- Fabric


def fabric_run(world_size: int, kind: str) -> tuple[Any, Any, Any, Any]:
    """A fresh Fabric run: ``ModelParallelStrategy`` (FSDP2 over the data-parallel mesh), the MoE,
    AdamW (two groups) and its LambdaLR."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        lambda model, mesh: drill.parallelize(model, mesh["data_parallel"]),
        data_parallel_size=world_size,
        tensor_parallel_size=1,
        save_distributed_checkpoint=KINDS[kind],
    )
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(dsd_moe.model(0))
    optimizer = fabric.setup_optimizers(dsd_moe.optimizer(model))
    return fabric, model, optimizer, dsd_moe.scheduler(optimizer)


def fabric_train(fabric: Any, model: Any, optimizer: Any, scheduler: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = dsd_moe.batch(step, rank)
        fabric.backward(model(x, y)["loss"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def fabric_outcome(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    return drill.outcome(model.module, optimizer.optimizer, scheduler)


def fabric_load(fabric: Any, path: Path, model: Any, optimizer: Any, scheduler: Any) -> None:
    """The docs block's ``resume`` before ``install()``: ``fabric.load``, whose DCP path hands a
    Stateful's dict back in ``state`` instead of loading it (the one-file path loads it)."""
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    fabric.load(path, state)
    if state["scheduler"] is not scheduler:
        scheduler.load_state_dict(state["scheduler"])


def fabric_saves(rank: int, world_size: int, root: str) -> None:
    """The uninterrupted run, the stock checkpoints, then (installed) the sparse ones."""
    _quiet()
    run = fabric_run(world_size, "dcp")
    fabric_train(*run, range(drill.STEPS), rank)
    drill.save_reference(root, "fabric", fabric_outcome(*run[1:]))
    at_save = {}
    for kind in KINDS:
        fabric, model, optimizer, scheduler = run = fabric_run(world_size, kind)
        fabric_train(*run, range(drill.SAVE_AT), rank)
        at_save[kind] = fabric_outcome(model, optimizer, scheduler)
        fabric.save(Path(root) / f"stock-{kind}", {"model": model, "optimizer": optimizer, "scheduler": scheduler})

    docs = installed(FABRIC_BLOCK)  # after Lightning's imports: the usual order
    for kind in KINDS:
        fabric, model, optimizer, scheduler = run = fabric_run(world_size, kind)
        fabric_train(*run, range(drill.SAVE_AT), rank)
        docs["save"](fabric, model, optimizer, scheduler, path=Path(root) / f"sparse-{kind}")
        drill.assert_same(
            fabric_outcome(model, optimizer, scheduler), at_save[kind], f"{kind}: after the installed save"
        )


def fabric_resumes(rank: int, world_size: int, root: str) -> None:
    """Fresh processes: the stock resumes fail (pinned); installed, every checkpoint resumes exactly."""
    _quiet()
    reference = drill.load_reference(root, "fabric")
    for kind in KINDS:
        fabric, model, optimizer, scheduler = fabric_run(world_size, kind)
        error, pattern = stock_error(kind, "optimizer", UNROUTED)
        with pytest.raises(error, match=pattern):
            fabric_load(fabric, Path(root) / f"stock-{kind}", model, optimizer, scheduler)
        assert len(optimizer.optimizer.state) == dsd_moe.PARAMS  # DSD's synthetic step: 18 invented
        assert [g["lr"] for g in optimizer.param_groups] == drill.FRESH_LRS

    docs = installed(FABRIC_BLOCK)
    for kind in KINDS:
        for source in ("stock", "sparse"):
            fabric, model, optimizer, scheduler = run = fabric_run(world_size, kind)
            docs["resume"](fabric, model, optimizer, scheduler, path=Path(root) / f"{source}-{kind}")
            assert len(optimizer.optimizer.state) == dsd_moe.STEPPED, (kind, source)
            fabric_train(*run, range(drill.SAVE_AT, drill.STEPS), rank)
            drill.assert_resumed(
                fabric_outcome(model, optimizer, scheduler), reference, f"Fabric {kind}, {source} checkpoint"
            )


@_backends.only(_backends.DEFAULT)
def test_fabric_model_parallel_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    run_ranks(fabric_saves, 2, str(tmp_path), timeout=300)
    run_ranks(fabric_resumes, 2, str(tmp_path), timeout=300)


# --------------------------------------------------------------------------- Trainer


def trainer_module() -> Any:
    """A LightningModule: the MoE sharded in ``configure_model``, AdamW + LambdaLR stepped every step;
    step ``i`` trains on :func:`dsd_moe.batch` ``(i, rank)`` whatever the data loader yields."""
    import lightning as L

    class MoeModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.moe = dsd_moe.model(0)

        def configure_model(self) -> None:
            drill.parallelize(self.moe, self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = dsd_moe.batch(self.global_step, self.global_rank)
            return self.moe(x, y)["loss"]

        def configure_optimizers(self) -> Any:
            optimizer = dsd_moe.optimizer(self.moe)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": dsd_moe.scheduler(optimizer), "interval": "step"},
            }

    return MoeModule()


def trainer(world_size: int, kind: str, steps: int) -> Any:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        data_parallel_size=world_size, tensor_parallel_size=1, save_distributed_checkpoint=KINDS[kind]
    )
    return L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


def data() -> Any:
    return torch.utils.data.DataLoader(list(range(drill.STEPS)), batch_size=None)


def trainer_outcome(t: Any, module: Any) -> dict[str, Any]:
    return drill.outcome(module.moe, t.optimizers[0], t.lr_scheduler_configs[0].scheduler)


def trainer_saves(rank: int, world_size: int, root: str) -> None:
    _quiet()
    t, module = trainer(world_size, "dcp", drill.STEPS), trainer_module()
    t.fit(module, data())
    drill.save_reference(root, "trainer", trainer_outcome(t, module))
    for kind in KINDS:
        t, module = trainer(world_size, kind, drill.SAVE_AT), trainer_module()
        t.fit(module, data())
        t.save_checkpoint(Path(root) / f"stock-{kind}.ckpt")

    docs = installed(TRAINER_BLOCK)  # after Lightning's imports: the usual order
    for kind in KINDS:
        t, module = trainer(world_size, kind, drill.SAVE_AT), trainer_module()
        t.fit(module, data())
        docs["save"](t, path=Path(root) / f"sparse-{kind}.ckpt")
        assert len(t.optimizers[0].state) == dsd_moe.STEPPED


def trainer_resumes(rank: int, world_size: int, root: str) -> None:
    _quiet()
    reference = drill.load_reference(root, "trainer")
    for kind in KINDS:
        t, module = trainer(world_size, kind, drill.STEPS), trainer_module()
        error, pattern = stock_error(kind, "optimizer_0", f"moe.{UNROUTED}")
        with pytest.raises(error, match=pattern):
            t.fit(module, data(), ckpt_path=Path(root) / f"stock-{kind}.ckpt")
        assert len(t.optimizers[0].state) == dsd_moe.PARAMS  # DSD's synthetic step: 18 invented
        assert [g["lr"] for g in t.optimizers[0].param_groups] == drill.FRESH_LRS

    docs = installed(TRAINER_BLOCK)
    for kind in KINDS:
        for source in ("stock", "sparse"):
            t, module = trainer(world_size, kind, drill.STEPS), trainer_module()
            docs["resume"](t, module, data(), path=Path(root) / f"{source}-{kind}.ckpt")
            assert t.global_step == drill.STEPS
            drill.assert_resumed(trainer_outcome(t, module), reference, f"Trainer {kind}, {source}")


@_backends.only(_backends.DEFAULT)
def test_trainer_model_parallel_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    run_ranks(trainer_saves, 2, str(tmp_path), timeout=300)
    run_ranks(trainer_resumes, 2, str(tmp_path), timeout=300)


@_backends.only(_backends.DEFAULT)
def test_docs_blocks_install_and_define_save_and_resume() -> None:
    for marker in (FABRIC_BLOCK, TRAINER_BLOCK):
        block = drill.doc_block(PAGE, marker)
        assert "sc_dsd.install()" in block.code and "def save(" in block.code and "def resume(" in block.code
