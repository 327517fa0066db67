"""Ctrl-C inside ``dcp.load``: an interrupted load never breaks the next one.

DCP's ``DefaultLoadPlanner.create_local_plan`` sets a module-wide flag
(``torch.distributed.checkpoint._version._derived_version = "2_3"``) around its probe for a torch <= 2.3
checkpoint and resets it without a ``finally``: an interrupt in that window left every later
``flatten_state_dict`` flattening the old way, and the next load failed with ``Missing key in
checkpoint state_dict``. `sparse_ckpt.SparseLoadPlanner` skips the probe when only optimizer entries
it chose not to plan are missing, clears the flag after the probe whatever happens, and clears a flag
left set before it flattens a target.

* A line sweep: a ``sys.settrace`` tracer raises ``KeyboardInterrupt`` at the N-th line event of a
  frame of the package *or of DCP* (``torch/distributed/checkpoint``) during ``dcp.load``, for a
  deterministic sample of N over the whole load (bench/drills/interrupted_loads.py runs random real
  signals over thousands of loads); after each, the flag is clear and a clean load is exact.
* The probe path (a checkpoint item the target lacks outside the optimizer) is swept the same way.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import _backends
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.default_planner as dcp_planner
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import _torch_internals

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PKG_DIR = os.path.dirname(os.path.abspath(sc.__file__)) + os.sep
DCP_DIR = os.path.dirname(os.path.abspath(dcp.__file__)) + os.sep
SAMPLES = 48
"""Interrupt points per sweep: every ``total // SAMPLES``-th line event of ~6 000 (the window DCP's
flag was left open in spans ~100 of them; ``python -m bench.interrupted_loads --sweep`` runs all)."""


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(1)
    return model, torch.optim.AdamW(model.parameters(), lr=0.3)


@pytest.fixture
def saved(tmp_path: Any) -> Callable[..., tuple[str, dict[str, Any]]]:
    """``saved(fmt, layout, extra=False)``: a checkpoint of a stepped AdamW (``extra``: plus a model
    item no target has) and the optimizer's ``state_dict()``."""

    def make(fmt: str, layout: str, extra: bool = False) -> tuple[str, dict[str, Any]]:
        model = _model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 3)).sum().backward()
        model[1].bias.grad = None
        opt.step()
        model_sd = dict(model.state_dict())
        if extra:
            model_sd["extra"] = torch.ones(2)
        path = str(tmp_path / f"{fmt}-{layout}-{extra}")
        dcp.save(
            {"model": model_sd, "optim": sc.SparseOptimizerState(model, opt, format=fmt, state_layout=layout)},
            checkpoint_id=path,
        )
        return path, opt.state_dict()

    return make


def _load(path: str, fmt: str) -> dict[str, Any]:
    model, opt = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt, format=fmt)},
            checkpoint_id=path,
            planner=sc.SparseLoadPlanner(),
        )
    return opt.state_dict()


def _assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert got["param_groups"] == want["param_groups"], where
    assert got["state"].keys() == want["state"].keys(), where
    for i, s in want["state"].items():
        assert got["state"][i].keys() == s.keys(), where
        for k, v in s.items():
            assert torch.equal(got["state"][i][k], v), f"{where}: state {i}.{k}"


class _Injector:
    """Counts line events of package and DCP frames; raises ``KeyboardInterrupt`` at the ``at``-th."""

    def __init__(self, at: int) -> None:
        self.at, self.count, self.where = at, 0, ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._local if frame.f_code.co_filename.startswith((PKG_DIR, DCP_DIR)) else None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.at:
                self.where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
                raise KeyboardInterrupt
        return self._local


def _traced(op: Callable[[], Any], at: int) -> _Injector:
    injector = _Injector(at)
    previous = sys.gettrace()
    sys.settrace(injector)
    try:
        op()
    except (KeyboardInterrupt, dcp.api.CheckpointException):
        pass  # DCP wraps an interrupt inside its reads in a CheckpointException
    finally:
        sys.settrace(previous)
    return injector


@_backends.only(_backends.DEFAULT)  # what is interrupted is DCP's and the planner's Python, not the core
@pytest.mark.parametrize(
    ("fmt", "layout", "extra"),
    [("packed", "auto", False), ("packed", "per_tensor", False), ("flat", "auto", False), ("packed", "auto", True)],
    ids=["packed-auto", "packed-per_tensor", "flat", "packed-probe"],
)
def test_load_interrupted_at_sampled_lines(saved: Any, fmt: str, layout: str, extra: bool) -> None:
    """An interrupt at any sampled line of the package or of DCP inside ``dcp.load`` leaves DCP's
    flatten flag clear, and the next, uninterrupted load is exact (``extra``: the checkpoint holds an
    item the target lacks outside the optimizer, so DCP's probe for an old checkpoint runs)."""
    path, want = saved(fmt, layout, extra)
    _assert_same(_load(path, fmt), want, "uninterrupted")
    total = _traced(lambda: _load(path, fmt), 0).count
    assert total > SAMPLES, total
    interrupted = 0
    for at in range(1, total + 1, max(1, total // SAMPLES)):
        injector = _traced(lambda: _load(path, fmt), at)
        interrupted += bool(injector.where)
        where = injector.where or f"event {at}"
        assert _torch_internals.dcp_flatten_flag() is None, f"an interrupt at {where} left DCP's flatten flag set"
        _assert_same(_load(path, fmt), want, f"the load after an interrupt at {where}")
    assert interrupted >= SAMPLES // 2, interrupted


def test_flag_left_set_is_cleared(saved: Any) -> None:
    """A flatten flag left at ``"2_3"`` (by an interrupted stock load) does not break the next load."""
    path, want = saved("packed", "auto")
    from torch.distributed.checkpoint import _version

    _version._derived_version = "2_3"
    try:
        _assert_same(_load(path, "packed"), want, "a load with the flag left set")
        assert _torch_internals.dcp_flatten_flag() is None
    finally:
        _version._derived_version = None


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_no_probe_when_only_optimizer_entries_are_unplanned(saved: Any, monkeypatch: Any, fmt: str) -> None:
    """When the only checkpoint items the target lacks are the optimizer entries the planner leaves
    out, the plan is made without DCP's probe: no flatten runs with the flag set."""
    path, want = saved(fmt, "auto")
    seen: list[Any] = []
    real = dcp_planner.flatten_state_dict

    def spy(state_dict: Any) -> Any:
        seen.append(_torch_internals.dcp_flatten_flag())
        return real(state_dict)

    monkeypatch.setattr(dcp_planner, "flatten_state_dict", spy)
    _assert_same(_load(path, fmt), want, "load")
    assert seen == [None], seen


def test_flag_left_set_is_cleared_under_dsd_install(tmp_path: Any) -> None:
    """Under ``integrations.dsd.install()``, a stock ``dcp.load`` (``DefaultLoadPlanner``) of DSD's dict
    is exact with DCP's flatten flag left at ``"2_3"`` by an interrupted load."""
    from torch.distributed.checkpoint import _version
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    import sparse_ckpt.integrations.dsd as sc_dsd

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    installed = sc_dsd.installed()
    sc_dsd.install()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
            model2, opt2 = _fresh()
            target = {"optim": get_optimizer_state_dict(model2, opt2)}
            _version._derived_version = "2_3"
            dcp.load(target, checkpoint_id=str(tmp_path))
            set_optimizer_state_dict(model2, opt2, target["optim"])
    finally:
        _version._derived_version = None
        if not installed:
            sc_dsd.uninstall()
    _assert_same(opt2.state_dict(), opt.state_dict(), "installed load with the flag left set")
