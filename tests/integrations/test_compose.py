"""Integrations compose: any two active together load what each loads alone.

The pairs the launcher's default selection activates together are ``dsd`` + ``torchtune`` and
``dsd`` + ``veomni``; ``dsd`` + ``accelerate`` is refused (docs/launcher.md; tests/launcher/). The
matrix, pair x checkpoint kind:

| pair | checkpoint kinds (both install orders unless said) | where |
| --- | --- | --- |
| dsd + torchtune | torchtune's own and stock, sync and async | ``test_torchtune.py`` (its drill; 2nd order ``slow``) |
| dsd + torchtune | torchtune's stock async load target via the DSD hook (placeholder groups) | here (no torchtune) |
| dsd + veomni | VeOmni's own (``MultiOptimizer``, one AdamW, async) and stock (migrated) | ``test_veomni.py`` (drill) |
| dsd + torchtune, dsd + veomni | DSD's own, stock DSD's, nested and flat | here |

The DSD hook plans every ``dcp.load`` of the process, so it must accept every load target DCP
accepts, whoever built it (the torchtune integration's placeholder groups hold ``"params": None``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _backends
import dsd_moe
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_deep_equal
from torch.distributed.checkpoint.state_dict import StateDictOptions

import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt.integrations import torchtune as sc_tune
from sparse_ckpt.integrations._torchtune_stock import TuneOptimizerState
from sparse_ckpt.integrations.dsd import functions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

LAYOUTS = {"nested": StateDictOptions(), "flat": StateDictOptions(flatten_optimizer_state_dict=True)}


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], list[float]]:
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}, [
        g["lr"] for g in opt.param_groups
    ]


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = dsd_moe.model(0)
    opt = dsd_moe.optimizer(model)
    sched = dsd_moe.scheduler(opt)
    dsd_moe.train(model, opt, sched, range(3))
    return model, opt


@pytest.fixture
def dsd_hook() -> Any:
    sc_dsd.install()
    yield
    sc_dsd.uninstall()


@_backends.only(_backends.DEFAULT)
def test_torchtunes_stock_async_target_loads_through_the_dsd_hook(tmp_path: Path, dsd_hook: Any) -> None:
    """torchtune's stock async checkpoint (``optimizer.state_dict()`` by parameter id in DCP) read by
    the torchtune integration's planner, its target's groups placeholders (``"params": None``), with
    the DSD hook active: loaded as saved (it was a ``TypeError`` inside DCP on every rank)."""
    model, opt = _trained()
    dcp.save({"optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh_model = dsd_moe.model(1)
    fresh = dsd_moe.optimizer(fresh_model)
    state = TuneOptimizerState(fresh_model, fresh, checkpoint_id=str(tmp_path), drop_synthetic=False)
    dcp.load({"optimizer": state}, checkpoint_id=str(tmp_path), planner=sc_tune._TuneLoadPlanner(), no_dist=True)
    assert state.stock and state.report is not None
    got = _state(fresh_model, fresh)
    assert len(got[0]) == dsd_moe.STEPPED
    assert_deep_equal(got, _state(model, opt), "stock async target through the DSD hook")


def _install_veomni() -> Callable[[], None]:
    import sparse_ckpt.integrations.veomni as sc_veomni

    sc_veomni.install()
    return sc_veomni.uninstall


def _install_torchtune() -> Callable[[], None]:
    sc_tune.install()
    return sc_tune.uninstall


OTHERS = {"veomni": ("veomni", _install_veomni), "torchtune": ("torchtune", _install_torchtune)}


@_backends.only(_backends.DEFAULT)
@pytest.mark.parametrize("dsd_first", [True, False], ids=["dsd-first", "dsd-second"])
@pytest.mark.parametrize("other", list(OTHERS))
def test_dsd_checkpoints_load_with_another_integration_active(tmp_path: Path, other: str, dsd_first: bool) -> None:
    """With ``other`` installed too (before or after the DSD hook), DSD's checkpoints load as with the
    DSD hook alone: the hook's own and stock DSD's (22 parameters with state), nested and flat, each
    exactly what was saved."""
    package, install_other = OTHERS[other]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    undo = []
    for which in ("dsd", other) if dsd_first else (other, "dsd"):
        if which == "dsd":
            sc_dsd.install()
            undo.append(sc_dsd.uninstall)
        else:
            undo.append(install_other())
    try:
        for layout, options in LAYOUTS.items():
            for source, get in (
                ("sparse", sc_dsd.get_optimizer_state_dict),
                ("stock", functions.torch_dsd["get_optimizer_state_dict"]),
            ):
                where = f"{source} DSD checkpoint, {layout}, with {other}"
                model, opt = _trained()
                path = str(tmp_path / f"{source}-{layout}")
                dcp.save({"optim": get(model, opt, options=options)}, checkpoint_id=path, no_dist=True)
                fresh_model = dsd_moe.model(1)
                fresh = dsd_moe.optimizer(fresh_model)
                target = {"optim": sc_dsd.get_optimizer_state_dict(fresh_model, fresh, options=options)}
                dcp.load(target, checkpoint_id=path, no_dist=True)
                sc_dsd.set_optimizer_state_dict(fresh_model, fresh, target["optim"], options=options)
                want = _state(model, opt)
                assert len(want[0]) == dsd_moe.STEPPED, where
                assert_deep_equal(_state(fresh_model, fresh), want, where)
    finally:
        for step in reversed(undo):
            step()
