"""NeMo Automodel (nemo-automodel 0.7.0) ``Checkpointer.save_optimizer``/``load_optimizer`` and ``integrations.dsd``.

The trainer drill (:mod:`trainer_drill`) with the real package: 2 Gloo ranks, FSDP2 over a CPU
mesh, the MoE of :mod:`dsd_moe`, a checkpoint after step 3 through NeMo Automodel's ``Checkpointer``
(``save_model`` + ``save_optimizer`` with the scheduler; ``OptimizerState``: DSD's flat layout),
a resume in a fresh set of processes (``load_model`` + ``load_optimizer``), two more steps,
compared with the uninterrupted run. Two optimizers:

- SGD with momentum. Stock (pinned): the resume fails with ``Missing key in checkpoint state_dict:
  optim.state.layers.0.experts.4.weight.momentum_buffer`` after DSD's synthetic step put a
  ``momentum_buffer`` on all 40 parameters. With ``sparse_ckpt.integrations.dsd.install()`` after
  NeMo's imports (the usage block of docs/integrations/nemo-automodel.md, "NeMo Automodel", run as written; NeMo
  copies the dict ``get_optimizer_state_dict`` returned into a new one, which ``install()``
  recognises): the stock checkpoint and the installed run's own resume exactly (22 states, the
  scheduler's lrs, bit for bit).
- AdamW. NeMo's own ``OptimizerState.state_dict`` first calls ``_materialize_missing_adam_state``,
  which writes ``step=0`` and zero moments for every parameter without state into the *live*
  optimizer, at save (22 -> 40) and on the fresh optimizer at load, so the checkpoint holds 40 states
  and the resume "works" with 40 (pinned, stock and installed alike: no generic mechanism can undo
  what the trainer writes into its own optimizer). The values are harmless (Adam creates exactly
  that state on a parameter's first step), so parameters and the 22 real states are bit-exact.
  The NeMo-specific remedy of docs/integrations/nemo-automodel.md (one line: the materializer made a no-op) with
  ``install()`` gives 22 states and the exact resume; without ``install()`` a checkpoint saved with
  it fails to resume (``Missing key ... experts.4.weight.step``, pinned).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "nemo_automodel",
    reason="nemo-automodel is not installed (pip install --no-deps -r .ci/requirements-nemo-automodel.txt)",
)

import _backends
import dsd_moe
import trainer_drill as drill
from _dist import run_ranks
from doc_blocks import ROOT, run_block

pytestmark = drill.MARKS

PAGE = ROOT / "docs/integrations/nemo-automodel.md"
"""The trainer's page, whose blocks this drill runs as written."""
OPTIMIZERS = {"sgd": drill.sgd, "adamw": dsd_moe.optimizer}
STOCK_ERROR = r"Missing key in checkpoint state_dict: optim\.state\.layers\.0\.experts\.4\.weight\.momentum_buffer"
ADAM_ERROR = r"Missing key in checkpoint state_dict: optim\.state\.layers\.0\.experts\.4\.weight\.step"
BLOCK = "checkpointer.save_optimizer(optimizer, model, path, scheduler)"
REMEDY = "_materialize_missing_adam_state = lambda"


def fresh(kind: str) -> tuple[Any, Any, Any]:
    model = drill.sharded()
    optimizer = OPTIMIZERS[kind](model)
    return model, optimizer, dsd_moe.scheduler(optimizer)


def checkpointer(rank: int) -> Any:
    """NeMo's Checkpointer as the docs block builds it (DCP shards for the model: the MoE is no HF model)."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer, CheckpointingConfig

    config = CheckpointingConfig(checkpoint_dir="ckpt/nemo", model_save_format="torch_save", save_consolidated=False)
    return Checkpointer(config, dp_rank=rank, tp_rank=0, pp_rank=0)


def save(rank: int, path: Path, model: Any, optimizer: Any, scheduler: Any) -> None:
    """The docs block's ``save`` once it ran (installed), else the same calls."""
    if docs:
        return docs["save"](model, optimizer, scheduler, path=str(path))
    ckpt = checkpointer(rank)
    ckpt.save_model(model, str(path))
    ckpt.save_optimizer(optimizer, model, str(path), scheduler)
    return None


def load(rank: int, path: Path, model: Any, optimizer: Any, scheduler: Any) -> None:
    """The docs block's ``resume`` once it ran (installed), else the same calls."""
    if docs:
        return docs["resume"](model, optimizer, scheduler, path=str(path))
    ckpt = checkpointer(rank)
    ckpt.load_model(model, str(path / "model"))
    ckpt.load_optimizer(optimizer, model, str(path), scheduler)
    return None


docs: dict[str, Any] = {}
"""The usage block's names once it ran in this process (it calls ``install()``)."""


def install(root: str) -> None:
    """Run the usage block of docs/integrations/nemo-automodel.md ("NeMo Automodel") in ``root``."""
    os.chdir(root)
    docs.update(run_block(drill.doc_block(PAGE, BLOCK), {"__name__": "docs"}))
    assert docs["sc_dsd"].installed()


def remedy() -> None:
    """Run the NeMo-specific remedy block of docs/integrations/nemo-automodel.md, as written."""
    from nemo_automodel.components.checkpoint import stateful_wrappers

    run_block(drill.doc_block(PAGE, REMEDY), {"__name__": "docs"})
    assert stateful_wrappers._materialize_missing_adam_state(None) is None  # the no-op


def invented(optimizer: Any, model: Any, steps: int) -> None:
    """The state NeMo's materializer adds: on the 18 parameters that never stepped, ``step=0`` and
    zero moments; ``steps`` steps on the other 22."""
    names = {p: n for n, p in model.named_parameters()}
    zero = {names[p] for p, s in optimizer.state.items() if float(s["step"]) == 0}
    assert len(zero) == dsd_moe.PARAMS - dsd_moe.STEPPED
    assert all(n.startswith("vision.") or ".experts." in n for n in zero), sorted(zero)
    for p, s in optimizer.state.items():
        if names[p] in zero:
            assert not s["exp_avg"].to_local().any() and not s["exp_avg_sq"].to_local().any(), names[p]
        else:
            assert float(s["step"]) == steps, names[p]


def real_part(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """``result`` with its state cut to the parameters ``reference`` has state for."""
    state = {
        leaf: {fqn: v for fqn, v in s.items() if fqn in reference["state"][leaf]} for leaf, s in result["state"].items()
    }
    return {**result, "state": state, "with_state": reference["with_state"]}


def saves(rank: int, world_size: int, root: str) -> None:
    """The uninterrupted runs, the stock checkpoints, then (installed) the sparse ones."""
    at_save = {}
    for kind in OPTIMIZERS:
        model, optimizer, scheduler = fresh(kind)
        dsd_moe.train(model, optimizer, scheduler, range(drill.STEPS), rank)
        drill.save_reference(root, f"nemo-{kind}", drill.outcome(model, optimizer, scheduler))
        model, optimizer, scheduler = fresh(kind)
        dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT), rank)
        at_save[kind] = drill.outcome(model, optimizer, scheduler)
        save(rank, Path(root) / f"stock-{kind}", model, optimizer, scheduler)
        after = len(optimizer.state)
        assert after == (dsd_moe.PARAMS if kind == "adamw" else dsd_moe.STEPPED)  # AdamW: NeMo's materializer
        if kind == "adamw":
            invented(optimizer, model, drill.SAVE_AT)

    install(root)  # after NeMo's imports: the usual order
    model, optimizer, scheduler = fresh("sgd")
    dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT), rank)
    save(rank, Path(root) / "sparse-sgd", model, optimizer, scheduler)
    drill.assert_same(drill.outcome(model, optimizer, scheduler), at_save["sgd"], "SGD: after the installed save")

    model, optimizer, scheduler = fresh("adamw")
    dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT), rank)
    save(rank, Path(root) / "materialized-adamw", model, optimizer, scheduler)
    assert len(optimizer.state) == dsd_moe.PARAMS  # install() alone: NeMo still writes into its optimizer

    remedy()
    model, optimizer, scheduler = fresh("adamw")
    dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT), rank)
    save(rank, Path(root) / "sparse-adamw", model, optimizer, scheduler)
    drill.assert_same(
        drill.outcome(model, optimizer, scheduler), at_save["adamw"], "AdamW (remedy): after the installed save"
    )


def resumes(rank: int, world_size: int, root: str) -> None:
    """Fresh processes: stock SGD fails, stock AdamW resumes with 40 states (pinned); installed,
    SGD resumes exactly; with the remedy, AdamW too."""
    from torch.distributed.checkpoint.api import CheckpointException

    references = {kind: drill.load_reference(root, f"nemo-{kind}") for kind in OPTIMIZERS}

    def resume(kind: str, source: str) -> tuple[Any, Any, dict[str, Any]]:
        model, optimizer, scheduler = fresh(kind)
        load(rank, Path(root) / f"{source}-{kind}", model, optimizer, scheduler)
        dsd_moe.train(model, optimizer, scheduler, range(drill.SAVE_AT, drill.STEPS), rank)
        return model, optimizer, drill.outcome(model, optimizer, scheduler)

    def materialized(kind: str, source: str) -> None:
        """AdamW through NeMo's materializer: 40 states; parameters, lrs and the 22 real states exact."""
        model, optimizer, got = resume(kind, source)
        assert got["with_state"] == dsd_moe.PARAMS, source
        invented(optimizer, model, drill.STEPS)
        drill.assert_same(
            real_part(got, references[kind]), references[kind], f"AdamW, {source} checkpoint (materialized)"
        )

    model, optimizer, scheduler = fresh("sgd")
    with pytest.raises(CheckpointException, match=STOCK_ERROR):
        load(rank, Path(root) / "stock-sgd", model, optimizer, scheduler)
    assert len(optimizer.state) == dsd_moe.PARAMS  # DSD's synthetic step: a momentum_buffer for all 40
    assert [g["lr"] for g in optimizer.param_groups] == drill.FRESH_LRS
    materialized("adamw", "stock")

    install(root)
    for source in ("stock", "sparse"):
        drill.assert_resumed(resume("sgd", source)[2], references["sgd"], f"SGD, {source} checkpoint")
    for source in ("stock", "materialized"):
        materialized("adamw", source)  # install() alone: NeMo's materializer still fills the fresh optimizer

    docs["sc_dsd"].uninstall()
    remedy()
    model, optimizer, scheduler = fresh("adamw")
    with pytest.raises(CheckpointException, match=ADAM_ERROR):  # the remedy alone: DSD's synthetic step
        load(rank, Path(root) / "sparse-adamw", model, optimizer, scheduler)

    docs["sc_dsd"].install()
    drill.assert_resumed(resume("adamw", "sparse")[2], references["adamw"], "AdamW (remedy), its own checkpoint")
    materialized("adamw", "stock")  # what NeMo wrote into a checkpoint stays there


@_backends.only(_backends.DEFAULT)
def test_nemo_automodel_save_load_optimizer_with_dsd_install(tmp_path: Path) -> None:
    run_ranks(saves, 2, str(tmp_path), timeout=300)
    run_ranks(resumes, 2, str(tmp_path), timeout=300)


@_backends.only(_backends.DEFAULT)
def test_the_remedy_disables_the_materializer_nemo_calls() -> None:
    """The remedy names a NeMo function that exists and that ``OptimizerState.state_dict`` calls."""
    import inspect

    from nemo_automodel.components.checkpoint import stateful_wrappers

    assert REMEDY.split(" =")[0] in drill.doc_block(PAGE, REMEDY).code
    assert callable(stateful_wrappers._materialize_missing_adam_state)
    assert "_materialize_missing_adam_state(optimizer)" in inspect.getsource(
        stateful_wrappers.OptimizerState.state_dict
    )
    assert "sc_dsd.install()" in drill.doc_block(PAGE, BLOCK).code
