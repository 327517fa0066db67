"""Complete or refused, as a property: a small DCP checkpoint with ANY single optimizer item removed
from its ``.metadata`` (a partial copy) either fails the load with a ``SparseCheckpointError``
subclass -- the target optimizer exactly as it was -- or loads exactly what was saved.

Every kind of state: per-item tensors, scalars that live only in the scalar table (Adam's
``step``, LBFGS's ``func_evals``/``n_iter``), list-valued state (LBFGS's ``al``, ``old_dirs``,
``old_stps``, ``ro``: one DCP item per element), buffers and layout tables, and several leaves;
both state layouts, strict and not. By default each sweep removes a `_sampling.sample` of the items
(every kind, the first and the last) and each optimizer is swept in one layout and strictness of
four (`SWEEPS`); CI sweeps each in all four and removes each item.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _sampling import params, sample
from helpers import assert_optimizer_equal, snapshot_optimizer
from legacy_checkpoints import drop_from_metadata
from lost_item_sweep import item_kind
from torch import nn

import sparse_ckpt as sc

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _lbfgs(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=3, max_iter=2)


OPTIMIZERS: dict[str, Callable[[nn.Module], Any]] = {
    "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    "SGD-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "LBFGS": _lbfgs,
    "multi": lambda m: sc.MultiOptimizer(
        m,
        {
            "first": torch.optim.AdamW(m[0].parameters(), lr=0.01),
            "second": torch.optim.SGD(m[1].parameters(), lr=0.1, momentum=0.9),
        },
    ),
}


def _train(model: nn.Module, opt: Any, steps: int, seed: int = 0) -> None:
    if isinstance(opt, torch.optim.LBFGS):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed))
        for _ in range(steps):

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = model(x).pow(2).sum()
                loss.backward()
                return loss

            opt.step(closure)
        return
    for s in range(steps):
        _grads(model, seed + s)
        opt.step()
    if not isinstance(opt, sc.MultiOptimizer):
        opt.zero_grad()


def _state(model: nn.Module, opt: Any, layout: str, strict: bool = True) -> sc.SparseOptimizerState:
    return sc.SparseOptimizerState(model, opt, state_layout=layout, strict=strict)


def _outcomes(name: str, layout: str, strict: bool, tmp_path: Path) -> dict[str, str]:
    model = _model(0)
    opt = OPTIMIZERS[name](model)
    _train(model, opt, 3)
    path = tmp_path / "ckpt"
    dcp.save({"optim": _state(model, opt, layout)}, checkpoint_id=path)
    original = (path / ".metadata").read_bytes()
    keys = [k for k in pickle.loads(original).state_dict_metadata if k.startswith("optim.")]
    keys = sample(keys, f"{name}-{layout}-{strict}", item_kind)
    outcomes: dict[str, str] = {}
    for key in keys:
        (path / ".metadata").write_bytes(original)
        drop_from_metadata(path, key)
        target_model = _model(0)
        target_model.load_state_dict(model.state_dict())
        target = OPTIMIZERS[name](target_model)
        _train(target_model, target, 1, seed=7)  # state of its own: a refusal must keep it
        target_model.load_state_dict(model.state_dict())
        before = snapshot_optimizer(target)
        try:
            dcp.load(
                {"optim": _state(target_model, target, layout, strict)},
                checkpoint_id=path,
                planner=sc.SparseLoadPlanner(),
            )
        except sc.SparseCheckpointError as exc:
            assert_optimizer_equal(target, before, grads=False)
            outcomes[key] = f"refused: {type(exc).__name__}"
            continue
        assert_optimizer_equal(target, opt, grads=False)  # loaded: exactly what was saved
        outcomes[key] = "loaded"
    return outcomes


_VARIANTS = [(layout, strict) for strict in (True, False) for layout in ("per_tensor", "buffers")]
SWEEPS = [(name, *_VARIANTS[(i + j) % 4]) for i, name in enumerate(OPTIMIZERS) for j in range(4)]
"""Every optimizer, layout and strictness; by default (`_sampling.params`) each optimizer in one of the
four variants, the variants taking turns, and a seeded share of the rest."""


@pytest.mark.parametrize(("name", "layout", "strict"), params(SWEEPS, "lost-item-sweeps", lambda case: case[0]))
def test_any_single_lost_item_is_refused_or_harmless(name: str, layout: str, strict: bool, tmp_path: Path) -> None:
    outcomes = _outcomes(name, layout, strict, tmp_path)
    loaded = sorted(k for k, v in outcomes.items() if v == "loaded")
    # Only the items no reader needs may go: the planner guard and the foreign-loader guards.
    assert all(k.startswith("optim.__sparse_ckpt__.") or k.endswith(".lr") for k in loaded), loaded
    assert len(outcomes) - len(loaded) >= 3


@pytest.mark.parametrize("layout", ["per_tensor", "buffers"])
@pytest.mark.parametrize("name", ["LBFGS", "Adam"])
def test_a_lost_scalar_table_is_refused_by_name(name: str, layout: str, tmp_path: Path) -> None:
    """A lost scalar table is refused by name: it is LBFGS's only record of ``func_evals``/``n_iter`` (it
    loaded silently without them), and Adam's of ``step`` (torch's ``__setstate__`` KeyError was
    reported as "written by another optimizer class?")."""
    model = _model(0)
    opt = OPTIMIZERS[name](model)
    _train(model, opt, 3)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path)
    drop_from_metadata(tmp_path, "optim.state.__packed__.optim.w1r0")
    target = OPTIMIZERS[name](model)
    with pytest.raises(
        sc.CheckpointMismatchError, match=r"leaf 'optim': checkpoint item 'state\.__packed__\.optim\.w1r0' is missing"
    ):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model, target, state_layout=layout)},
            checkpoint_id=tmp_path,
            planner=sc.SparseLoadPlanner(),
        )
    assert not target.state


@pytest.mark.parametrize("which", ["last", "first"])
@pytest.mark.parametrize("key", ["al", "old_dirs", "old_stps", "ro"])
def test_a_lost_list_element_is_refused(key: str, which: str, tmp_path: Path) -> None:
    """The last element (the list would load shorter) or the first (a hole)."""
    model = _model(0)
    opt = _lbfgs(model)
    _train(model, opt, 3)
    n = len(opt.state[model[0].weight][key])
    assert n >= 2
    index = n - 1 if which == "last" else 0
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path)
    drop_from_metadata(tmp_path, f"optim.state.0.weight.{key}.{index}")
    target = _lbfgs(model)
    with pytest.raises(sc.CheckpointMismatchError, match=rf"'0\.weight'|state\.0\.weight\.{key}\.{index}"):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model, target)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner()
        )
    assert not target.state


def test_a_lost_leaf_group_table_is_refused_with_strict_false(tmp_path: Path) -> None:
    """Without its group table a leaf's state has no FQNs to resolve against: refused, not skipped."""
    model = _model(0)
    opt = OPTIMIZERS["multi"](model)
    _train(model, opt, 2)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path)
    drop_from_metadata(tmp_path, "optim.param_groups.__packed__.second.w1r0")
    target = OPTIMIZERS["multi"](model)
    with pytest.raises(sc.CheckpointMismatchError, match=r"leaf 'second'"):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model, target, strict=False)},
            checkpoint_id=tmp_path,
            planner=sc.SparseLoadPlanner(),
        )


def test_verify_reports_a_lost_scalar_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``verify`` reads the item record as a load does (exit 1, naming the item)."""
    from sparse_ckpt.tools import _cli as cli

    model = _model(0)
    opt = _lbfgs(model)
    _train(model, opt, 2)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path)
    assert cli.main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    drop_from_metadata(tmp_path, "optim.state.__packed__.optim.w1r0")
    assert cli.main(["verify", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "state.__packed__.optim.w1r0" in captured.out + captured.err
