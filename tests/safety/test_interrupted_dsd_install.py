"""Ctrl-C inside ``integrations.dsd.install()`` / ``uninstall()``: all or nothing, and ``installed()`` true to it.

``install()`` changes five objects (the code of torch DSD's four functions, ``DefaultLoadPlanner.set_up_planner``).
A ``KeyboardInterrupt`` at the N-th line event of a package frame (``run_traced`` of test_interrupt_safety),
for every N of the run, must leave all five patched or none, ``installed()`` saying which, and the next
``install()`` must complete it (then a fresh optimizer's dict holds no state: routed). The same for
``uninstall()``, after which torch's functions hold their very own code objects again.
"""

from __future__ import annotations

import gc
from typing import Any

import _backends
import pytest
import torch
import torch.distributed.checkpoint.state_dict as dsd_module
from test_interrupt_safety import assert_nothing_held, run_traced
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import sparse_ckpt.integrations.dsd as sc_dsd
from sparse_ckpt.integrations._rebind import routed
from sparse_ckpt.integrations.dsd import functions, patching

TORCH_CODE = {n: getattr(dsd_module, n).__code__ for n in functions.ROUTED}
TORCH_PLANNER = vars(DefaultLoadPlanner)["set_up_planner"]


def patched() -> list[bool]:
    """Which of the five objects ``install()`` changes are patched now."""
    fns = [getattr(dsd_module, n) for n in functions.ROUTED]
    return [routed(f) for f in fns] + [vars(DefaultLoadPlanner)["set_up_planner"] is patching._set_up_planner]


def assert_all_or_nothing(where: str) -> bool:
    state = patched()
    assert len(set(state)) == 1, f"interrupt at {where}: partly patched {state}"
    assert sc_dsd.installed() is state[0], f"interrupt at {where}: installed() is {sc_dsd.installed()}, patched {state}"
    return state[0]


def assert_routed(where: str) -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sd = dsd_module.get_optimizer_state_dict(model, opt)
    assert not opt.state and not sd["state"], f"after the interrupt at {where}: stock DSD ran (synthetic step)"


def assert_torchs_own(where: str) -> None:
    assert not any(patched()), f"{where}: {patched()}"
    assert all(getattr(dsd_module, n).__code__ is c for n, c in TORCH_CODE.items()), f"{where}: torch's code not back"
    assert vars(DefaultLoadPlanner)["set_up_planner"] is TORCH_PLANNER, where


@pytest.fixture
def restore() -> Any:
    yield
    sc_dsd.uninstall()


@_backends.only(_backends.DEFAULT)  # install() runs no core
def test_install_interrupted_at_every_line(restore: Any) -> None:
    gc_was = gc.isenabled()
    total = run_traced(sc_dsd.install, 0)[0].count
    sc_dsd.uninstall()
    assert total > 10, total
    for at in range(1, total + 1):
        injector, interrupted = run_traced(sc_dsd.install, at)
        where = injector.where or f"line event {at} (not reached)"
        assert_nothing_held(gc_was, where)  # patching's lock released
        assert interrupted, f"line event {at} of {total} was not reached"
        assert_all_or_nothing(where)
        sc_dsd.install()  # completes whatever the interrupt left
        assert sc_dsd.installed() and all(patched()), where
        assert_routed(where)
        sc_dsd.uninstall()
        assert_torchs_own(where)


@_backends.only(_backends.DEFAULT)
def test_uninstall_interrupted_at_every_line(restore: Any) -> None:
    gc_was = gc.isenabled()
    sc_dsd.install()
    total = run_traced(sc_dsd.uninstall, 0)[0].count
    assert total > 5, total
    for at in range(1, total + 1):
        sc_dsd.install()
        injector, interrupted = run_traced(sc_dsd.uninstall, at)
        where = injector.where or f"line event {at} (not reached)"
        assert interrupted, f"line event {at} of {total} was not reached"
        assert_nothing_held(gc_was, where)
        if assert_all_or_nothing(where):
            assert_routed(where)
        sc_dsd.uninstall()  # completes whatever the interrupt left
        assert_torchs_own(where)
