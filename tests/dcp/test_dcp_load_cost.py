"""What one ``dcp.load`` of a SparseOptimizerState costs: no capture of the load target (its
state_dict hooks do not run, nothing of it is serialized) and one FQN map (built by the planner,
reused by the load); the same for every Stateful users put into ``dcp.load`` (a MultiOptimizer,
a state over a mapping or a trainer's container). Counts, never times."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, make_moe, train

import sparse_ckpt as sc
import sparse_ckpt._dcp.planner as sc_dcp
import sparse_ckpt._dcp.stateful as sc_stateful
import sparse_ckpt._load.load as sc_load
from sparse_ckpt._format.keys import PLANNER_GUARD_KEY, is_foreign_guard
from sparse_ckpt._torch_internals import called_by_dcp_load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_moe(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 2, only_experts=[0, 1])
    return model, opt


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_load_target_is_not_captured_and_fqn_map_built_once(tmp_path: Path, fmt: str, monkeypatch) -> None:
    model, opt = _trained(0)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=fmt)}, checkpoint_id=tmp_path / "c")

    model2 = make_moe(0)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    hook_calls: list[str] = []
    opt2.register_state_dict_pre_hook(lambda o: hook_calls.append("pre"))
    opt2.register_state_dict_post_hook(lambda o, sd: hook_calls.append("post"))
    builds: list[int] = []
    real = sc_dcp.build_fqn_map

    def counting(m: Any) -> Any:
        builds.append(1)
        return real(m)

    monkeypatch.setattr(sc_dcp, "build_fqn_map", counting)
    monkeypatch.setattr(sc_load, "build_fqn_map", counting)
    dcp.load(
        {"optim": sc.SparseOptimizerState(model2, opt2)}, checkpoint_id=tmp_path / "c", planner=sc.SparseLoadPlanner()
    )
    assert hook_calls == []  # the load target was never captured (torch's state_dict would run hooks)
    assert len(builds) == 1  # the planner's map is the load's
    assert_optimizer_equal(opt2, opt, grads=False)  # state in the saved order, as torch keeps it


def test_state_dict_outside_dcp_load_is_full() -> None:
    """Called by anyone but dcp.load (dcp.save, the user), state_dict() is the whole sparse dict."""
    model, opt = _trained(1)
    st = sc.SparseOptimizerState(model, opt)
    sd = st.state_dict()
    full = sc.sparse_state_dict(model, opt, state_layout=st.state_layout)
    guards = {k for k, v in sd.items() if is_foreign_guard(k, v)}
    assert PLANNER_GUARD_KEY in sd and sd.keys() == {PLANNER_GUARD_KEY, *full, *guards} and len(guards) == 2
    assert not called_by_dcp_load(sys._getframe())


def test_fmap_of_another_state_is_not_reused(tmp_path: Path) -> None:
    """A planned dict handed to another SparseOptimizerState's load_state_dict: that state walks
    its own model (the planner's map belongs to the dict's owner)."""
    model, opt = _trained(2)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "c")
    model2 = make_moe(2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    st2 = sc.SparseOptimizerState(model2, opt2)
    target = {"optim": st2.state_dict()}
    dcp.load(target, checkpoint_id=tmp_path / "c", planner=sc.SparseLoadPlanner())
    planned = target["optim"]
    assert planned.fmap is not None
    model3 = make_moe(2)
    model3.load_state_dict(model.state_dict())
    opt3 = torch.optim.AdamW(model3.parameters(), lr=0.5)
    sc.SparseOptimizerState(model3, opt3).load_state_dict(planned)
    assert_optimizer_equal(opt3, opt, grads=False)


def _leaf_opts(model: torch.nn.Module) -> dict[str, torch.optim.Optimizer]:
    return {
        "dense": torch.optim.AdamW(model.dense_params(), lr=0.01),
        "experts": torch.optim.AdamW(model.expert_params(), lr=0.01),
    }


def _veomni_container(model: torch.nn.Module, opts: dict[str, torch.optim.Optimizer]) -> Any:
    try:
        from veomni.optim.optimizer import MultiOptimizer as VeOmniMultiOptimizer
    except ImportError as exc:
        pytest.skip(f"veomni is not installed ({exc}); CI installs it from .ci/requirements-veomni.txt")
    return VeOmniMultiOptimizer(model, opts, key_names=list(opts))


STATEFULS = {
    # what users put into dcp.load, built from the model and its leaves {name: optimizer}
    "state(optimizer)": lambda model, opts: sc.SparseOptimizerState(model, opts["dense"]),
    "state(mapping)": lambda model, opts: sc.SparseOptimizerState(model, opts),
    "state(MultiOptimizer)": lambda model, opts: sc.SparseOptimizerState(model, sc.MultiOptimizer(model, opts)),
    "MultiOptimizer": lambda model, opts: sc.MultiOptimizer(model, opts),
    "MultiOptimizer(buffers)": lambda model, opts: sc.MultiOptimizer(model, opts, state_layout="buffers"),
    "state(VeOmni container)": lambda model, opts: sc.SparseOptimizerState(model, _veomni_container(model, opts)),
    "MultiOptimizer(VeOmni container)": lambda model, opts: sc.MultiOptimizer(model, _veomni_container(model, opts)),
}


@pytest.mark.parametrize("kind", list(STATEFULS))
def test_no_stateful_load_target_is_captured(tmp_path: Path, kind: str, monkeypatch) -> None:
    """Every Stateful users put into dcp.load: DCP calls its state_dict() for a
    load target, which must not run the optimizers' state_dict hooks nor capture them; the
    MultiOptimizer wraps SparseOptimizerState.state_dict, which once saw the wrapper as its caller."""
    model = make_moe(3)
    opts = _leaf_opts(model)
    saved = STATEFULS[kind](model, opts)
    train(
        model, saved if isinstance(saved, sc.MultiOptimizer) else sc.MultiOptimizer(model, opts), 2, only_experts=[0, 1]
    )
    dcp.save({"optim": saved}, checkpoint_id=tmp_path / "c")

    model2 = make_moe(3)
    model2.load_state_dict(model.state_dict())
    opts2 = _leaf_opts(model2)
    for o in opts2.values():
        o.param_groups[0]["lr"] = 0.5
    target = STATEFULS[kind](model2, opts2)
    hook_calls: list[str] = []
    for o in opts2.values():
        o.register_state_dict_pre_hook(lambda o: hook_calls.append("pre"))
        o.register_state_dict_post_hook(lambda o, sd: hook_calls.append("post"))
    captures: list[int] = []
    real = sc_stateful.build_state_dict

    def counting(*args: Any, **kwargs: Any) -> Any:
        captures.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sc_stateful, "build_state_dict", counting)
    dcp.load({"optim": target}, checkpoint_id=tmp_path / "c", planner=sc.SparseLoadPlanner())
    assert (hook_calls, captures) == ([], [])
    for name, o in opts2.items():
        if kind != "state(optimizer)" or name == "dense":
            assert_optimizer_equal(o, opts[name], grads=False)
    # the same Stateful, called by anyone but dcp.load, is captured (a save)
    target.state_dict()
    assert len(captures) == 1 and hook_calls
