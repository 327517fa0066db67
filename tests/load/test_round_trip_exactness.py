"""Round trips stay exact on the paths where exactness was once lost, each walked the way a user walks it:

* a MultiOptimizer put straight into dcp.save/dcp.load restores everything (scheduler-moved lr too);
* packed, strict=False: state is resolved by the checkpoint's FQNs, never by the target's;
* what save writes, load reads back exactly (colliding canonical FQNs, a parameter in two groups,
  dotted / int / '~' state keys, nested state that looks like another FQN) or save refuses;
* the wrong optimizer class, and same-numel wrong-shape state, are mismatches;
* a torch Optimizer.state_dict() is recognised;
* the flat format keeps custom param_names;
* SparseLoadPlanner reads flat param_groups values with weights_only=True.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, make_moe, snapshot_optimizer, train
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import sparse_ckpt as sc
import sparse_ckpt._fqn

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# --------------------------------------------------------------------------- MultiOptimizer in DCP


def _moe_multi(seed: int) -> tuple[nn.Module, sc.MultiOptimizer, dict[str, Any]]:
    model = make_moe(seed)
    mo = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(model.expert_params(), lr=0.01),
            "dense": torch.optim.AdamW(model.dense_params(), lr=0.01),
        },
    )
    scheds = {name: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for name, opt in mo.leaves()}
    return model, mo, scheds


@pytest.mark.parametrize("async_", [False, True], ids=["save", "async_save"])
@pytest.mark.parametrize("moved_lr", [False, True], ids=["lr-as-built", "lr-moved-by-scheduler"])
def test_multi_optimizer_straight_into_dcp(tmp_path: Path, async_: bool, moved_lr: bool) -> None:
    model, mo, scheds = _moe_multi(0)
    train(model, mo, 2, only_experts=[0, 2])
    if moved_lr:
        for sched in scheds.values():
            sched.step()
    state = {"model": model.state_dict(), "optim": mo}
    if async_:
        dcp.async_save(state, checkpoint_id=tmp_path).result()
    else:
        dcp.save(state, checkpoint_id=tmp_path)

    model2, mo2, _ = _moe_multi(1)
    msd = model2.state_dict()
    dcp.load({"model": msd, "optim": mo2}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    model2.load_state_dict(msd)
    assert_optimizer_equal(mo, mo2, grads=False)
    assert sum(len(opt.state) for _, opt in mo2.leaves()) == sum(len(opt.state) for _, opt in mo.leaves()) > 0
    assert not mo2["experts"].state.get(model2.experts[1].up.weight)  # unrouted: no state invented
    expected_lr = 0.005 if moved_lr else 0.01
    assert [g["lr"] for g in mo2["dense"].param_groups] == [expected_lr]
    train(model, mo, 1, only_experts=[0, 1], seed=9)
    train(model2, mo2, 1, only_experts=[0, 1], seed=9)
    assert_optimizer_equal(mo, mo2, grads=False)


def test_planner_load_is_transactional_when_a_post_hook_raises(tmp_path: Path) -> None:
    model, mo, _ = _moe_multi(0)
    train(model, mo, 2)
    dcp.save({"optim": mo}, checkpoint_id=tmp_path)
    model2, mo2, _ = _moe_multi(1)
    model2.load_state_dict(model.state_dict())
    train(model2, mo2, 1, seed=4)
    before = snapshot_optimizer(mo2)

    def boom(_opt: Any) -> None:
        raise RuntimeError("post-hook boom")

    mo2["dense"].register_load_state_dict_post_hook(boom)
    with pytest.raises(RuntimeError, match="post-hook boom"):
        dcp.load({"optim": mo2}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    assert_optimizer_equal(before, mo2)


# --------------------------------------------------------------------------- no misattribution


class _Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)


class _ProjParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(4, 4))


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_state_never_lands_on_a_prefix_parameter(fmt: str) -> None:
    src = _Proj()
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    src.proj(torch.ones(2, 4)).sum().backward()
    opt.step()
    sd = sc.sparse_state_dict(src, opt, format=fmt)
    assert "state.proj.weight.momentum_buffer" in sd

    dst = _ProjParam()
    dst_opt = torch.optim.SGD(dst.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(sc.CheckpointMismatchError, match="proj"):
        sc.load_sparse_state_dict(dst, dst_opt, sd)
    with pytest.raises(sc.CheckpointMismatchError, match="none of the checkpoint's 1 saved parameter"):
        sc.load_sparse_state_dict(dst, dst_opt, sd, strict=False)  # nothing would load: refused too
    assert not dst_opt.state.get(dst.proj)
    assert dst_opt.param_groups[0]["lr"] == 0.5


# --------------------------------------------------------------------------- save == load


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((3,), 2.0))


class _RootAndCompiled(nn.Module):
    """A root ``w`` and ``_orig_mod.w``: torch.compile's prefix is stripped, so both canonicalise to ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self._orig_mod = _Inner()


def _step(model: nn.Module, opt: torch.optim.Optimizer, scale: float = 1.0) -> None:
    opt.zero_grad()
    sum((p * (i + 1) * scale).sum() for i, p in enumerate(model.parameters())).backward()
    opt.step()


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_two_parameters_with_one_canonical_fqn(fmt: str) -> None:
    model = _RootAndCompiled()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt)
    sd = sc.sparse_state_dict(model, opt, format=fmt)
    assert "state.w.exp_avg" in sd and "state._orig_mod.w.exp_avg" in sd
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert_optimizer_equal(opt, opt2, grads=False)
    assert not torch.equal(opt2.state[model2.w]["exp_avg"], opt2.state[model2._orig_mod.w]["exp_avg"])


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_parameter_in_two_groups_round_trips_like_torch(fmt: str) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.param_groups.extend(opt.param_groups)  # torch saves and loads this
    _step(model, opt)
    sd = sc.sparse_state_dict(model, opt, format=fmt)

    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.7, momentum=0.9)
    opt2.param_groups.extend(opt2.param_groups)
    ref = copy.deepcopy(opt2)
    ref.load_state_dict(opt.state_dict())
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert [g["lr"] for g in opt2.param_groups] == [0.1, 0.1]
    assert_optimizer_equal(ref, opt2, grads=False)


def test_parameter_in_two_groups_with_different_settings_is_refused() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups.append({**opt.param_groups[0], "lr": 0.2})
    with pytest.raises(sc.CheckpointMismatchError, match=r"leaf 'optim'.*'weight'.*group 0 and group 1"):
        sc.sparse_state_dict(model, opt)


ODD_KEYS: dict[Any, Any] = {"ema.decay": torch.tensor(0.5), 7: torch.tensor(7.0), "~x": 1, "%2E": "s", "": 3.0}


def _odd_state_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(2, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    opt.state[model.weight].update(copy.deepcopy(ODD_KEYS))
    opt.state[model.weight]["nested"] = {"a.b": torch.ones(1), 3: {"c": torch.zeros(2)}}
    return model, opt


def test_state_keys_with_dots_ints_and_escapes_round_trip_packed(tmp_path: Path) -> None:
    model, opt = _odd_state_optimizer()
    sd = sc.sparse_state_dict(model, opt)
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.3, momentum=0.9)
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert_optimizer_equal(opt, opt2, grads=False)
    assert list(opt2.state[model2.weight]) == list(opt.state[model.weight])  # keys (and their types) exactly

    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path)  # through DCP too
    model3 = copy.deepcopy(model)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.3, momentum=0.9)
    dcp.load({"optim": sc.SparseOptimizerState(model3, opt3)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    assert_optimizer_equal(opt, opt3, grads=False)


def test_state_keys_the_flat_layout_cannot_hold_are_refused() -> None:
    model, opt = _odd_state_optimizer()
    with pytest.raises(sc.CheckpointFormatError, match=r"leaf 'optim': state key 'ema\.decay' of 'weight'.*flat"):
        sc.sparse_state_dict(model, opt, format="flat")
    opt.state[model.weight] = {"momentum_buffer": torch.ones(2, 2), 7: torch.ones(1)}
    with pytest.raises(sc.CheckpointFormatError, match="state key 7 of 'weight'"):
        sc.sparse_state_dict(model, opt, format="flat")
    opt.state[model.weight] = {(1, 2): torch.ones(1)}
    with pytest.raises(sc.CheckpointFormatError, match="is a tuple"):
        sc.sparse_state_dict(model, opt)


def _x_and_x_exp_avg() -> nn.Module:
    """Parameters with canonical FQNs ``x`` and ``x.exp_avg`` (the second under a stripped
    ``_orig_mod`` wrapper: a plain module cannot hold a parameter and a submodule of one name)."""
    root = nn.Module()
    root.register_parameter("x", nn.Parameter(torch.ones(2)))
    root._orig_mod = nn.Module()
    root._orig_mod.x = nn.Module()
    root._orig_mod.x.register_parameter("exp_avg", nn.Parameter(torch.ones(2)))
    return root


def test_nested_state_named_like_another_parameter() -> None:
    """``x`` with nested state ``{"exp_avg": {"v": t}}`` next to a parameter ``x.exp_avg``: packed
    escapes the part so the state comes back to ``x``; flat (DSD's layout) refuses it."""
    model = _x_and_x_exp_avg()
    assert sc._fqn.build_fqn_map(model).param_of.keys() == {"x", "x.exp_avg"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt)
    opt.state[model.x]["exp_avg"] = {"v": torch.full((2,), 5.0)}
    sd = sc.sparse_state_dict(model, opt)
    assert "state.x.~sexp_avg.v" in sd
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert_optimizer_equal(opt, opt2, grads=False)
    assert set(opt2.state[model2._orig_mod.x.exp_avg]) == {"momentum_buffer"}
    with pytest.raises(sc.CheckpointFormatError, match="would be read back as state of parameter 'x.exp_avg'"):
        sc.sparse_state_dict(model, opt, format="flat")


# --------------------------------------------------------------------------- wrong class / shape


def test_wrong_optimizer_class_is_a_mismatch() -> None:
    model = nn.Linear(3, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, sgd)
    sd = sc.sparse_state_dict(model, sgd)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, adamw)
    before = snapshot_optimizer(adamw)
    with pytest.raises(sc.CheckpointMismatchError) as info:
        sc.load_sparse_state_dict(model, adamw, sd, strict=False)
    msg = str(info.value)
    assert "leaf 'optim'" in msg and "AdamW" in msg and "'weight'" in msg and "momentum_buffer" in msg, msg
    assert_optimizer_equal(before, adamw)


@pytest.mark.parametrize("shape", [(16,), (1, 4, 4), (4, 4, 1)])
def test_same_numel_wrong_shape_is_refused(shape: tuple[int, ...]) -> None:
    model = nn.Linear(4, 4, bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)
    sd = sc.sparse_state_dict(model, opt)
    sd["state.weight.exp_avg"] = sd["state.weight.exp_avg"].reshape(shape)
    opt2 = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(sc.CheckpointMismatchError, match=r"'exp_avg' of 'weight' has shape"):
        sc.load_sparse_state_dict(model, opt2, sd)
    assert not opt2.state


def test_scalar_state_of_a_one_element_parameter_is_fine() -> None:
    """0-d state (ASGD's eta/mu, NAdam's mu_product) next to a ``(1,)`` parameter is not a wrong shape."""
    model = nn.Linear(3, 1)
    for cls in (torch.optim.ASGD, torch.optim.NAdam):
        opt = cls(model.parameters(), lr=0.01)
        _step(model, opt)
        opt2 = cls(model.parameters(), lr=0.01)
        sc.load_sparse_state_dict(model, opt2, sc.sparse_state_dict(model, opt))
        assert_optimizer_equal(opt, opt2, grads=False)


# --------------------------------------------------------------------------- flat param_names


def test_flat_format_keeps_custom_param_names() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW([{"params": [("name0", model.weight), ("name1", model.bias)]}], lr=0.01)
    _step(model, opt)
    sd = sc.sparse_state_dict(model, opt, format="flat")
    opt2 = torch.optim.AdamW([{"params": [("other0", model.weight), ("other1", model.bias)]}], lr=0.5)
    sc.load_sparse_state_dict(model, opt2, sd)
    assert opt2.param_groups[0]["param_names"] == ["name0", "name1"]
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


# --------------------------------------------------------------------------- weights_only


class _Payload:
    """Unpickling this would call ``print`` (a stand-in for arbitrary code)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (print, ("PAYLOAD RAN",))


def test_planner_reads_flat_group_values_weights_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    sd = sc.sparse_state_dict(model, opt, format="flat")
    sd["param_groups.weight.lr"] = _Payload()
    dcp.save({"optim": sd}, checkpoint_id=tmp_path)
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    with pytest.raises(CheckpointException, match=r"optimizer item 'optim\.param_groups\.weight\.lr'"):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model, opt2, format="flat")},
            checkpoint_id=tmp_path,
            planner=sc.SparseLoadPlanner(),
        )
    assert "PAYLOAD RAN" not in capsys.readouterr().out
    assert opt2.param_groups[0]["lr"] == 0.5


def test_weights_only_item_passes_plain_values() -> None:
    from sparse_ckpt._dcp.items import weights_only_item

    buf = io.BytesIO()
    torch.save({"a": [1, 2.0, "x", None]}, buf)
    buf.seek(0)
    out = weights_only_item("k", buf, table=False)
    assert torch.load(out, weights_only=True) == {"a": [1, 2.0, "x", None]}
