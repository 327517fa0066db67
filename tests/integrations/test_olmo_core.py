"""OLMo-core (ai2-olmo-core 3.0.0), resumed exactly by ``integrations.dsd``.

The trainer drill (:mod:`trainer_drill`) with the real package: 2 Gloo ranks, FSDP2 over a CPU
mesh, the MoE of :mod:`dsd_moe`, a checkpoint after step 3 through OLMo-core's own APIs, a resume in
a fresh set of processes, two more steps, compared with the uninterrupted run:

- ``olmo_core.train.checkpoint.Checkpointer.save``/``load`` of a ``BasicTrainModule`` (its
  ``state_dict``/``load_state_dict``: DSD, nested layout; the scheduler's state travels in the
  trainer state the checkpointer saves per rank). The train module is used for its checkpoint
  interface only: its ``train_batch`` is a language-model step (``input_ids``, cross-entropy)
  driven by OLMo's ``Trainer``, so the drill steps the same model and optimizer itself;
- ``olmo_core.distributed.checkpoint.save_model_and_optim_state``/``load_model_and_optim_state``
  with ``flatten_optimizer_state=True`` (DSD's flat layout).

Stock (pinned): both resumes fail with ``Missing key in checkpoint state_dict:
optim.state.layers.0.experts.4.weight.step`` after DSD's synthetic step put state on all 40
parameters of the fresh optimizer. With ``sparse_ckpt.integrations.dsd.install()`` called after
OLMo-core's imports (the block of docs/integrations/olmo-core.md, "OLMo-core", run as written: it installs and
defines the ``Checkpointer`` ``save``/``resume`` the installed runs call): the stock checkpoints and
the installed runs' own resume, the next steps equal the uninterrupted run bit for bit, 22 parameters
with state, ``vision``'s lr the scheduler's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "olmo_core", reason="ai2-olmo-core is not installed (pip install --no-deps -r .ci/requirements-olmo-core.txt)"
)

import _backends
import dsd_moe
import torch
import torch.distributed as dist
import trainer_drill as drill
from _dist import run_ranks
from doc_blocks import ROOT, run_block

pytestmark = drill.MARKS

PAGE = ROOT / "docs/integrations/olmo-core.md"
"""The trainer's page, whose blocks this drill runs as written."""
APIS = ("checkpointer", "flat")
"""``Checkpointer`` + ``BasicTrainModule``; ``save/load_model_and_optim_state(flatten_optimizer_state=True)``."""
STOCK_ERROR = r"Missing key in checkpoint state_dict: optim\.state\.layers\.0\.experts\.4\.weight\.step"
BLOCK = "checkpointer.save(path, BasicTrainModule("
docs: dict[str, Any] = {}
"""The docs block's names once it ran in this process (it calls ``install()``)."""


def install(root: str) -> None:
    """Run the docs block in ``root`` (its ``Checkpointer`` works under ``ckpt/``)."""
    os.chdir(root)
    docs.update(run_block(drill.doc_block(PAGE, BLOCK), {"__name__": "docs"}))
    assert docs["sc_dsd"].installed()


def fresh() -> tuple[Any, Any, Any]:
    model = drill.sharded()
    optimizer = dsd_moe.optimizer(model)
    return model, optimizer, dsd_moe.scheduler(optimizer)


def save(api: str, path: Path, model: Any, optimizer: Any, scheduler: Any) -> None:
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import BasicTrainModule

    if api == "checkpointer":
        state = {"global_step": drill.SAVE_AT, "scheduler": scheduler.state_dict()}
        if docs:  # installed: the docs' save
            docs["save"](model, optimizer, state, path=path)
        else:
            Checkpointer(work_dir=path.parent / "work").save(
                path, BasicTrainModule(model, optimizer, rank_microbatch_size=4), state
            )
    else:
        save_model_and_optim_state(path, model, optimizer, flatten_optimizer_state=True)
        scheduler_path(path).parent.mkdir(exist_ok=True)
        torch.save(scheduler.state_dict(), scheduler_path(path))


def load(api: str, path: Path, model: Any, optimizer: Any, scheduler: Any) -> None:
    from olmo_core.distributed.checkpoint import load_model_and_optim_state
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import BasicTrainModule

    if api == "checkpointer":
        if docs:  # installed: the docs' resume
            state = docs["resume"](model, optimizer, path=path)
        else:
            state = Checkpointer(work_dir=path.parent / "work").load(
                path, BasicTrainModule(model, optimizer, rank_microbatch_size=4)
            )
        assert state is not None and state["global_step"] == drill.SAVE_AT
        scheduler.load_state_dict(state["scheduler"])
    else:
        load_model_and_optim_state(path, model, optimizer, flatten_optimizer_state=True)
        scheduler.load_state_dict(torch.load(scheduler_path(path), weights_only=False))


def scheduler_path(path: Path) -> Path:
    """Where the flat API's drill keeps the scheduler (the API saves only model and optimizer)."""
    return path.parent / f"{path.name}-scheduler" / f"rank{dist.get_rank()}.pt"


def saves(rank: int, world_size: int, root: str) -> None:
    """The uninterrupted run, the stock checkpoints, then (installed) the sparse ones."""
    model, optimizer, scheduler = fresh()
    dsd_moe.train(model, optimizer, scheduler, range(drill.STEPS), rank)
    drill.save_reference(root, "olmo", drill.outcome(model, optimizer, scheduler))
    at_save = {}
    for api in APIS:
        model, optimizer, scheduler = fresh()
        dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT), rank)
        at_save[api] = drill.outcome(model, optimizer, scheduler)
        save(api, Path(root) / f"stock-{api}", model, optimizer, scheduler)

    install(root)  # after OLMo-core's imports: the usual order
    for api in APIS:
        model, optimizer, scheduler = fresh()
        dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT), rank)
        save(api, Path(root) / f"sparse-{api}", model, optimizer, scheduler)
        drill.assert_same(drill.outcome(model, optimizer, scheduler), at_save[api], f"{api}: after the installed save")


def resumes(rank: int, world_size: int, root: str) -> None:
    """Fresh processes: the stock resumes fail (pinned); installed, every checkpoint resumes exactly."""
    from torch.distributed.checkpoint.api import CheckpointException

    reference = drill.load_reference(root, "olmo")
    for api in APIS:
        model, optimizer, scheduler = fresh()
        with pytest.raises(CheckpointException, match=STOCK_ERROR):
            load(api, Path(root) / f"stock-{api}", model, optimizer, scheduler)
        assert len(optimizer.state) == dsd_moe.PARAMS  # DSD's synthetic step: 18 invented
        assert [g["lr"] for g in optimizer.param_groups] == drill.FRESH_LRS

    install(root)
    for api in APIS:
        for source in ("stock", "sparse"):
            model, optimizer, scheduler = fresh()
            load(api, Path(root) / f"{source}-{api}", model, optimizer, scheduler)
            assert len(optimizer.state) == dsd_moe.STEPPED, (api, source)
            dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT, drill.STEPS), rank)
            drill.assert_resumed(
                drill.outcome(model, optimizer, scheduler), reference, f"OLMo-core {api}, {source} checkpoint"
            )


@_backends.only(_backends.DEFAULT)
def test_olmo_core_resumes_exactly_with_dsd_install(tmp_path: Path) -> None:
    run_ranks(saves, 2, str(tmp_path), timeout=300)
    run_ranks(resumes, 2, str(tmp_path), timeout=300)


@_backends.only(_backends.DEFAULT)
def test_docs_block_installs_and_defines_save_and_resume() -> None:
    block = drill.doc_block(PAGE, BLOCK)
    assert "sc_dsd.install()" in block.code and "def save(" in block.code and "def resume(" in block.code
