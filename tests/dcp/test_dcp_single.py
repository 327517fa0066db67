"""DCP integration in a single process (no process group): SparseOptimizerState + SparseLoadPlanner."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, make_moe, moe_with_leaves, snapshot_optimizer, sparse_dcp_load, train
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import sparse_ckpt as sc
from sparse_ckpt._dcp.stateful import SparseStateDict
from sparse_ckpt._format.keys import PLANNER_GUARD_KEY

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

IDLE_LR = 0.0025


build = moe_with_leaves
"""TinyMoE with leaves: dense; experts 0-2 (one group each); idle (expert 3, never gets a grad)."""


def trained(seed: int = 0) -> tuple[nn.Module, sc.MultiOptimizer]:
    """Trained with only experts 0 and 1 routed (expert 2 and the idle leaf stay stateless)."""
    model, opt = build(seed)
    train(model, opt, 2, only_experts=[0, 1])
    for group in opt["idle"].param_groups:
        group["lr"] = IDLE_LR  # what a scheduler would do to a leaf that never stepped
    return model, opt


def save(path: Path, model: nn.Module, opt: Any, fmt: str = "packed") -> None:
    dcp.save(
        {"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt, format=fmt)}, checkpoint_id=path
    )


def load(path: Path, model: nn.Module, opt: Any, **kw: Any) -> None:
    msd = model.state_dict()
    dcp.load(
        {"model": msd, "optim": sc.SparseOptimizerState(model, opt, **kw)},
        checkpoint_id=path,
        planner=sc.SparseLoadPlanner(),
    )
    model.load_state_dict(msd)


def assert_resumed(src_model: nn.Module, src: sc.MultiOptimizer, model: nn.Module, opt: sc.MultiOptimizer) -> None:
    """Equal optimizers and params now, and after one more identical step on both."""
    assert_optimizer_equal(src, opt, grads=False)
    train(src_model, src, 1, only_experts=[0, 1], seed=100)
    train(model, opt, 1, only_experts=[0, 1], seed=100)
    assert_optimizer_equal(src, opt, grads=False)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_fresh_optimizer_resumes_exactly(tmp_path: Path, fmt: str) -> None:
    model, opt = trained()
    before = snapshot_optimizer(opt)
    save(tmp_path, model, opt, fmt)
    assert_optimizer_equal(before, opt)  # saving mutated nothing

    keys = set(dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata)
    assert not any(k.startswith(("optim.state.experts.2.", "optim.state.experts.3.")) for k in keys)
    if fmt == "packed":  # a group table per leaf, a scalar table per leaf with state (packed version 2)
        assert sum("__packed__" in k for k in keys) == 5
        assert sum(k.startswith("optim.state.__packed__.") for k in keys) == 2
        assert not any(k.endswith(".step") for k in keys)
        # besides the tables: one foreign-loader guard per leaf (its first FQN) and the nested layout's one
        guards = {k for k in keys if k.startswith("optim.param_groups.") and "__packed__" not in k}
        assert guards == {
            f"optim.param_groups.{fqn}.lr"
            for fqn in ("embed.weight", "experts.0.up.weight", "experts.3.up.weight", "0")
        }
    else:
        assert "optim.param_groups.experts.3.up.weight.lr" in keys  # flat: every param, stateless too
        assert not any("__packed__" in k for k in keys)

    model2, opt2 = build(seed=1)
    load(tmp_path, model2, opt2)
    assert [g["lr"] for g in opt2["idle"].param_groups] == [IDLE_LR]
    assert len(opt2["idle"].state) == 0
    assert not opt2["experts"].state.get(model2.experts[2].up.weight)
    p, p2 = model.experts[0].up.weight, model2.experts[0].up.weight
    assert torch.equal(opt2["experts"].state[p2]["exp_avg"], opt["experts"].state[p]["exp_avg"])
    assert_resumed(model, opt, model2, opt2)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
@pytest.mark.parametrize("as_multi", [False, True], ids=["SparseOptimizerState", "MultiOptimizer"])
@pytest.mark.parametrize(
    "planner",
    [None, DefaultLoadPlanner(), DefaultLoadPlanner(allow_partial_load=True)],
    ids=["no-planner", "default", "default-partial"],
)
def test_without_planner_fails_before_reading(tmp_path: Path, fmt: str, as_multi: bool, planner: Any) -> None:
    """Without SparseLoadPlanner, dcp.load fails while planning -- before any byte reaches the live
    state tensors -- naming the planner; also when every setting and state key would match."""
    model, opt = trained()
    dcp.save(
        {
            "model": model.state_dict(),
            "optim": opt if as_multi and fmt == "packed" else sc.SparseOptimizerState(model, opt, format=fmt),
        },
        checkpoint_id=tmp_path,
    )

    # A target that matches the checkpoint key for key: same settings, state for every saved param,
    # but different values -- DCP alone would read straight into these live tensors.
    model2, opt2 = trained(seed=1)
    before = snapshot_optimizer(opt2)
    params_before = copy.deepcopy(model2.state_dict())
    target = opt2 if as_multi else sc.SparseOptimizerState(model2, opt2, format=fmt)
    with pytest.raises(CheckpointException, match=r"planner=sparse_ckpt\.SparseLoadPlanner\(\)"):
        dcp.load({"model": model2.state_dict(), "optim": target}, checkpoint_id=tmp_path, planner=planner)
    assert_optimizer_equal(before, opt2)
    for k, v in params_before.items():  # the model part of the same dcp.load was not read either
        assert torch.equal(model2.state_dict()[k], v), k


def test_guard_is_a_plain_tensor_item(tmp_path: Path) -> None:
    """The planner guard is saved as an ordinary uint8 tensor (no custom class in the checkpoint)
    and is dropped by SparseLoadPlanner; pickles and copies of the dict hold a plain tensor."""
    model, opt = trained()
    sd = opt.state_dict()
    assert PLANNER_GUARD_KEY in sd
    for copied in (pickle.loads(pickle.dumps(sd)), copy.deepcopy(sd), sd.copy()):
        assert type(copied[PLANNER_GUARD_KEY]) is torch.Tensor
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=tmp_path)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata[f"optim.{PLANNER_GUARD_KEY}"]
    assert md.properties.dtype == torch.uint8 and tuple(md.size) == (1,)
    model2, opt2 = build(seed=1)
    msd = model2.state_dict()
    dcp.load({"model": msd, "optim": opt2}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    model2.load_state_dict(msd)
    assert_resumed(model, opt, model2, opt2)


def test_load_into_optimizer_with_state(tmp_path: Path) -> None:
    """A target with state of its own: every param ends up with exactly the checkpoint's state."""
    model, opt = trained()
    save(tmp_path, model, opt)
    model2, opt2 = build(seed=1)
    train(model2, opt2, 3, seed=7)  # all experts routed: expert 2 and the idle leaf get state here
    assert opt2["idle"].state and opt2["experts"].state.get(model2.experts[2].up.weight)
    load(tmp_path, model2, opt2)
    assert not opt2["idle"].state
    assert not opt2["experts"].state.get(model2.experts[2].up.weight)
    assert_resumed(model, opt, model2, opt2)


class Named(nn.Module):
    def __init__(self, names: list[str], seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleDict({n: nn.Linear(3, 3) for n in names})


def step_all(model: Named, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    sum(layer(torch.ones(2, 3)).sum() for layer in model.layers.values()).backward()
    opt.step()


def test_strict_rejects_extra_saved_params_and_is_transactional(tmp_path: Path) -> None:
    src = Named(["a", "b", "c"])
    src_opt = torch.optim.AdamW(src.parameters(), lr=0.01)
    step_all(src, src_opt)
    dcp.save({"optim": sc.SparseOptimizerState(src, src_opt)}, checkpoint_id=tmp_path)

    dst = Named(["a", "b"], seed=3)
    dst_opt = torch.optim.AdamW(dst.parameters(), lr=0.02)
    step_all(dst, dst_opt)
    before = snapshot_optimizer(dst_opt)
    with pytest.raises(sc.CheckpointMismatchError, match=r"layers\.c\.weight"):
        dcp.load(
            {"optim": sc.SparseOptimizerState(dst, dst_opt)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner()
        )
    assert_optimizer_equal(before, dst_opt)  # the planner read into new buffers, not the live state

    dcp.load(
        {"optim": sc.SparseOptimizerState(dst, dst_opt, strict=False)},
        checkpoint_id=tmp_path,
        planner=sc.SparseLoadPlanner(),
    )
    assert dst_opt.param_groups[0]["lr"] == 0.01
    for name in ("a", "b"):
        for pn in ("weight", "bias"):
            saved = src_opt.state[getattr(src.layers[name], pn)]
            got = dst_opt.state[getattr(dst.layers[name], pn)]
            assert torch.equal(saved["exp_avg_sq"], got["exp_avg_sq"]) and torch.equal(saved["step"], got["step"])


def test_async_save_captures_values_at_save_time(tmp_path: Path) -> None:
    model, opt = trained()
    at_save = snapshot_optimizer(opt)
    params_at_save = copy.deepcopy(model.state_dict())
    state = {"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)}
    future = dcp.async_save(state, checkpoint_id=tmp_path)
    train(model, opt, 2, only_experts=[0, 1, 2], seed=50)  # keeps training while the upload runs
    future.result()

    model2, opt2 = build(seed=1)
    load(tmp_path, model2, opt2)
    assert_optimizer_equal(at_save, opt2, grads=False)
    for k, v in params_at_save.items():
        assert torch.equal(model2.state_dict()[k], v), k
    assert not opt2["experts"].state.get(model2.experts[2].up.weight)  # it got state only after the save


def test_dsd_flat_checkpoint_loads(tmp_path: Path) -> None:
    """A checkpoint written by torch DSD (flatten_optimizer_state_dict=True) and dcp.save."""
    model = make_moe(0)
    opt = torch.optim.AdamW([{"params": model.dense_params()}, {"params": model.expert_params(), "lr": 0.003}])
    train(model, opt, 2, only_experts=[0])  # experts 1-3 stay stateless
    dsd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": model.state_dict(), "optim": dsd}, checkpoint_id=tmp_path)

    model2 = make_moe(1)
    opt2 = torch.optim.AdamW([{"params": model2.dense_params()}, {"params": model2.expert_params(), "lr": 0.5}])
    msd = model2.state_dict()
    sparse_dcp_load(tmp_path, model2, opt2, state={"model": msd})
    model2.load_state_dict(msd)
    assert_optimizer_equal(opt, opt2, grads=False)
    assert not opt2.state.get(model2.experts[1].up.weight)


def test_nested_state_dict_any_depth(tmp_path: Path) -> None:
    model, opt = trained()
    state = sc.SparseOptimizerState(model, opt)
    dcp.save({"run": {"train": {"optim": state.state_dict()}, "step": 7}}, checkpoint_id=tmp_path)

    model2, opt2 = build(seed=1)
    model2.load_state_dict(model.state_dict())
    state2 = sc.SparseOptimizerState(model2, opt2)
    target = {"run": {"train": {"optim": state2.state_dict()}, "step": 0}}
    dcp.load(target, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    assert target["run"]["step"] == 7
    state2.load_state_dict(target["run"]["train"]["optim"])
    assert_optimizer_equal(opt, opt2, grads=False)


def test_nested_stateful_object_is_refused(tmp_path: Path) -> None:
    model, opt = trained()
    state = sc.SparseOptimizerState(model, opt)
    with pytest.raises(CheckpointException, match="top level"):
        dcp.save({"run": {"optim": state}}, checkpoint_id=tmp_path / "a")
    save(tmp_path / "b", model, opt)
    with pytest.raises(CheckpointException, match="below the top level"):
        dcp.load({"run": {"optim": state}}, checkpoint_id=tmp_path / "b", planner=sc.SparseLoadPlanner())


def test_state_dict_copies_as_plain_dict() -> None:
    model, opt = trained()
    sd = sc.SparseOptimizerState(model, opt).state_dict()
    assert isinstance(sd, SparseStateDict) and sd.owner.model is model
    for copied in (copy.deepcopy(sd), copy.copy(sd), sd.copy()):
        assert type(copied) is dict
        assert list(copied) == list(sd)
    pickled = pickle.loads(pickle.dumps(sd))  # an OrderedDict: torch.load's weights_only refuses GLOBAL dict
    assert type(pickled) is OrderedDict and list(pickled) == list(sd)
    deep = copy.deepcopy(sd)
    key = next(k for k in sd if k.startswith("state.") and isinstance(sd[k], torch.Tensor))
    assert torch.equal(deep[key], sd[key]) and deep[key] is not sd[key]


@pytest.mark.parametrize("wrap", ["state", "multi"])
def test_state_dict_through_torch_save_loads_weights_only(wrap: str) -> None:
    """A Stateful's dict put through ``torch.save`` (a trainer's one-file checkpoint) reads back with
    ``torch.load``'s default ``weights_only=True`` and resumes exactly (it pickled as a GLOBAL
    ``builtins.dict``, which the weights-only unpickler refuses)."""
    model, opt = trained()
    state = sc.SparseOptimizerState(model, opt) if wrap == "state" else opt
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    back = torch.load(buf)  # weights_only=True is torch's default
    model2, opt2 = build(seed=1)
    model2.load_state_dict(model.state_dict())
    (sc.SparseOptimizerState(model2, opt2) if wrap == "state" else opt2).load_state_dict(back)
    assert_resumed(model, opt, model2, opt2)


def test_wrong_key_is_reported(tmp_path: Path) -> None:
    model, opt = trained()
    save(tmp_path, model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException, match="no optimizer entries under 'optimizer'"):
            sparse_dcp_load(tmp_path, model, opt, key="optimizer")
