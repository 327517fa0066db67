"""torchtune 0.6.1, resumed exactly by ``sparse_ckpt.integrations.torchtune``.

The trainer drill (:mod:`trainer_drill`) with the real package: 2 Gloo ranks, FSDP2 over a CPU mesh,
the MoE of :mod:`dsd_moe` (40 parameters, 22 stepped), a checkpoint after step 3 through torchtune's
own ``CheckpointClient`` (what ``recipes/full_finetune_distributed.py`` calls, see
:mod:`bench.tune_scenario`), a resume in a fresh set of processes, two more steps, compared with the
uninterrupted run. Both of torchtune's ways: sync (``FullModelTorchTuneCheckpointer``,
``training.get_full_optimizer_state_dict`` / ``load_from_full_optimizer_state_dict``) and async
(``enable_async_checkpointing``: ``DistributedCheckpointer``, ``load_distributed_checkpoint``).

Stock (pinned): the sync resume fails with ``KeyError: 'layers.0.experts.4.weight'`` (also with
``integrations.dsd.install()``: torchtune's load never calls DSD), the async one with ``Missing key in
checkpoint state_dict: optimizer.state.<id>.step``; both after torchtune's synthetic step gave the
fresh optimizer state for all 40 parameters. Installed: sparse_ckpt's checkpoints and the stock ones
resume bit for bit, 22 parameters with state, every group's lr (and ``initial_lr``, from which the
recipe rebuilds its scheduler) kept; a stock checkpoint's load says so in a migration report. A
never-stepped stock checkpoint (state invented for all 40) loads as saved, every parameter named as
possibly synthetic, or with ``drop_synthetic_state`` as the run from scratch; a stock async checkpoint
whose param groups do not match the optimizer's is refused with the optimizer untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "torchtune", reason="torchtune is not installed (pip install --no-deps -r .ci/requirements-torchtune.txt)"
)

import _backends
import dsd_moe
import torch
import trainer_drill as drill
from _dist import run_ranks
from doc_blocks import run_block
from torch.distributed.checkpoint.api import CheckpointException

from bench.trainers import tune_scenario as ts
from sparse_ckpt import CheckpointMismatchError
from sparse_ckpt.integrations import torchtune as sc_tune

pytestmark = drill.MARKS

MODES = {"sync": False, "async": True}
"""The drill's two ways, by ``enable_async_checkpointing``."""
UNSTEPPED = "unstepped"
"""A sync run saved before its first step (stock: state invented for all 40 parameters)."""
RUNS = {**MODES, UNSTEPPED: False}
BLOCK = "sc_tune.install()"
STOCK_ERRORS = {
    "sync": (KeyError, r"layers\.0\.experts\.4\.weight"),
    "async": (CheckpointException, r"Missing key in checkpoint state_dict: optimizer\.state\.\d+\.step"),
}


def fresh(steps: int = 0) -> tuple[Any, Any, Any]:
    """A sharded model, its AdamW (two groups) and a scheduler, trained ``steps`` steps."""
    model = drill.sharded()
    optimizer = dsd_moe.optimizer(model)
    scheduler = dsd_moe.scheduler(optimizer)
    dsd_moe.train(model, optimizer, scheduler, range(steps), torch.distributed.get_rank())
    return model, optimizer, scheduler


def rebuilt_scheduler(optimizer: Any, global_step: int) -> Any:
    """The recipe's ``_setup_lr_scheduler(..., last_epoch=global_step - 1)``: from the loaded
    ``initial_lr`` (a KeyError when the load lost it)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [lambda s: 0.9**s, lambda s: 0.5**s], last_epoch=global_step - 1
    )


def tune_outcome(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """:func:`trainer_drill.outcome`, the scheduler reduced to what a rebuilt one can equal."""
    snap = drill.outcome(model, optimizer, scheduler)
    snap["sched"] = {k: snap["sched"][k] for k in ("last_epoch", "_last_lr")}
    snap["initial_lrs"] = [g["initial_lr"] for g in optimizer.param_groups]
    return snap


def install() -> None:
    """The docs' block (docs/integrations/torchtune.md), run as written: it installs."""
    namespace = run_block(drill.doc_block(drill.PAGES / "torchtune.md", BLOCK), {"__name__": "docs"})
    assert namespace["sc_tune"].installed()


def saves(rank: int, world_size: int, root: str) -> None:
    """The uninterrupted run, stock checkpoints of both ways, then (installed) sparse ones."""
    model, optimizer, scheduler = fresh(drill.STEPS)
    drill.save_reference(root, "tune", tune_outcome(model, optimizer, scheduler))
    model, optimizer, scheduler = fresh(drill.STEPS - drill.SAVE_AT)
    drill.save_reference(root, "tune-scratch", tune_outcome(model, optimizer, scheduler))
    for source in ("stock", "sparse"):
        if source == "sparse":
            install()
        for run, async_ in RUNS.items():
            ts.write_base(Path(root) / f"{source}-{run}", dsd_moe.model(0))
            model, optimizer, scheduler = fresh(0 if run == UNSTEPPED else drill.SAVE_AT)
            before = tune_outcome(model, optimizer, scheduler)
            ts.save(Path(root) / f"{source}-{run}", model, optimizer, async_=async_)
            if source == "stock" and run == UNSTEPPED:  # DSD's synthetic step, in the live optimizer
                assert len(optimizer.state) == dsd_moe.PARAMS
            else:
                drill.assert_same(
                    tune_outcome(model, optimizer, scheduler), before, f"{source} {run}: the save changed the run"
                )
    sc_tune.uninstall()


def resume_run(root: str, source: str, mode: str, optimizers: list[Any] | None = None) -> tuple[Any, Any, Any]:
    """The recipe's resume of run ``{source}-{mode}`` into a fresh sharded model (the optimizer it
    builds goes into ``optimizers`` too, for a resume that raises)."""
    model = drill.sharded()

    def make_optimizer(m: Any) -> Any:
        optimizer = dsd_moe.optimizer(m)
        (optimizers if optimizers is not None else []).append(optimizer)
        return optimizer

    optimizer, _ = ts.resume(Path(root) / f"{source}-{mode}", model, make_optimizer, async_=RUNS[mode])
    return model, optimizer, rebuilt_scheduler(optimizer, 0 if mode == UNSTEPPED else drill.SAVE_AT)


ORDERS = {
    "alone": ("torchtune",),
    "torchtune, then the DSD hook": ("torchtune", "dsd"),
    "the DSD hook, then torchtune": ("dsd", "torchtune"),
}
"""The integrations active in a resume, in the order they were installed (the launcher's default
selection activates both)."""


def installed_resumes(root: str, rank: int, order: str) -> None:
    """Every checkpoint (sparse_ckpt's and stock, sync and async) resumes bit for bit with the
    integrations of ``order`` active (their import order aside, a pair loads what each loads alone)."""
    import sparse_ckpt.integrations.dsd as sc_dsd

    reference = drill.load_reference(root, "tune")
    for name in ORDERS[order]:
        install() if name == "torchtune" else sc_dsd.install()
    for mode in MODES:
        for source in ("sparse", "stock"):
            where = f"{mode}, {source} checkpoint, {order}"
            model, optimizer, scheduler = resume_run(root, source, mode)
            assert len(optimizer.state) == dsd_moe.STEPPED, where
            report = sc_tune.last_migration_report()
            if source == "sparse":
                assert report is None, where
            else:
                assert report is not None and report.trainer == "torchtune", where
                assert len(report.stateless["optim"]) == dsd_moe.PARAMS - dsd_moe.STEPPED, where
                assert report.exact and not report.dropped, where  # saved at step 3: nothing looks synthetic
            dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT, drill.STEPS), rank)
            got = tune_outcome(model, optimizer, scheduler)
            assert got["initial_lrs"] == reference["initial_lrs"], where
            drill.assert_resumed(got, reference, f"torchtune {where}")
    sc_dsd.uninstall()
    sc_tune.uninstall()


def resumes(rank: int, world_size: int, root: str) -> None:
    """Fresh processes: stock resumes fail (pinned); installed, every checkpoint resumes exactly."""
    import sparse_ckpt.integrations.dsd as sc_dsd

    for dsd_hook in (False, True):
        if dsd_hook:
            sc_dsd.install()
        for mode in MODES:
            built: list[Any] = []
            error, match = STOCK_ERRORS[mode]
            with pytest.raises(error, match=match):
                resume_run(root, "stock", mode, built)
            (optimizer,) = built
            assert len(optimizer.state) == dsd_moe.PARAMS  # torchtune's synthetic step: 18 invented
            assert [g["lr"] for g in optimizer.param_groups] == drill.FRESH_LRS
    sc_dsd.uninstall()

    installed_resumes(root, rank, "alone")
    installed_resumes(root, rank, "torchtune, then the DSD hook")

    sc_tune.install()  # a stock async checkpoint is read by position: other group sizes are refused, nothing loaded
    built: list[Any] = []

    def one_group(m: Any) -> Any:
        built.append(torch.optim.AdamW(m.parameters(), lr=0.01))
        return built[-1]

    with pytest.raises(CheckpointMismatchError, match="param groups hold parameter ids"):
        ts.resume(Path(root) / "stock-async", drill.sharded(), one_group, async_=True)
    assert not built[0].state and built[0].param_groups[0]["lr"] == 0.01
    sc_tune.uninstall()

    scratch = drill.load_reference(root, "tune-scratch")
    for drop in (False, True):
        sc_tune.install(drop_synthetic_state=drop)
        for source in ("sparse", "stock"):
            where = f"never-stepped {source} checkpoint, drop_synthetic_state={drop}"
            model, optimizer, scheduler = resume_run(root, source, UNSTEPPED)
            report = sc_tune.last_migration_report()
            if source == "sparse":
                assert report is None and not optimizer.state, where
            elif drop:  # AdamW's synthetic state: step 1, zero moments: dropped, named
                assert len(report.dropped) == dsd_moe.PARAMS and not report.possibly_synthetic, where
                assert len(report.stateless["optim"]) == dsd_moe.PARAMS and not optimizer.state, where
            else:  # kept as saved, every parameter named as possibly synthetic
                assert len(report.possibly_synthetic) == dsd_moe.PARAMS and not report.exact, where
                assert len(optimizer.state) == dsd_moe.PARAMS and not report.stateless["optim"], where
            if not optimizer.state:  # then it is the run from scratch, bit for bit
                dsd_moe.train(model, optimizer, scheduler, range(drill.STEPS - drill.SAVE_AT), rank)
                drill.assert_same(tune_outcome(model, optimizer, scheduler), scratch, where)
        sc_tune.uninstall()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The drill's saves (:func:`saves`, on the default backend), once for the module: the resumes only read them."""
    root = tmp_path_factory.mktemp("torchtune-saves")
    run_ranks(saves, 2, str(root), timeout=300)
    return str(root)


@_backends.only(_backends.DEFAULT)
def test_torchtune_resumes_exactly_with_the_integration(saved: str) -> None:
    """Stock torchtune's sync and async resumes fail on the drill MoE (with or without the DSD hook);
    installed, alone and with the DSD hook installed after it, its own and the stock checkpoints
    resume bit for bit; a never-stepped stock checkpoint resumes as saved or, with ``drop_synthetic_state``, as
    the run from scratch, each with its migration report."""
    run_ranks(resumes, 2, saved, timeout=300)


@_backends.only(_backends.DEFAULT)
def test_docs_block_installs() -> None:
    """The docs/integrations/torchtune.md block the drill runs is the one-line install."""
    assert (
        "import sparse_ckpt.integrations.torchtune as sc_tune"
        in drill.doc_block(drill.PAGES / "torchtune.md", BLOCK).code
    )


def resumes_dsd_first(rank: int, world_size: int, root: str) -> None:
    installed_resumes(root, rank, "the DSD hook, then torchtune")


@pytest.mark.slow
@_backends.only(_backends.DEFAULT)
def test_every_checkpoint_resumes_with_the_dsd_hook_installed_first(saved: str) -> None:
    """The pair in the other order (the DSD hook, then torchtune): sync and async, sparse_ckpt's and
    stock checkpoints resume bit for bit (the drill's saves, shared with the test above)."""
    run_ranks(resumes_dsd_first, 2, saved, timeout=300)
