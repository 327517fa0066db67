"""Trainer optimizer containers and pipeline-parallel model parts, wherever an optimizer or model is accepted.

The real containers are used where their package is installed (VeOmni's ``MultiOptimizer``,
torchtitan's ``OptimizersContainer``, Accelerate's ``AcceleratedOptimizer``); each of those tests is
skipped with the reason otherwise. Their recognition is by attributes only, so the rules (wrappers
that keep state of their own are not unwrapped, what an unknown container is told) are also tested
with small stand-ins.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import IdentitySnapshot
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.keys import is_state_item
from sparse_ckpt._leaves import named_leaves
from sparse_ckpt.errors import UnsupportedStateDictError


def _real(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        pytest.skip(f"{module} is not installed ({exc}); CI installs it from .ci/requirements-*.txt")


def _moe() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(3, 3) for _ in range(3)), "dense": nn.Linear(3, 3)})


def _train_expert0(model: nn.ModuleDict, opt, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model["experts"][0](model["dense"](torch.randn(4, 3))).pow(2).mean().backward()
        opt.step()


def _state_fqns(model: nn.Module, opts: list[torch.optim.Optimizer]) -> set[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for o in opts for p, s in o.state.items() if s}


# ----------------------------------------------------------------------------------------- VeOmni
def _veomni(model: nn.ModuleDict):
    vmo_cls = _real("veomni.optim.optimizer", "MultiOptimizer")
    opts = {
        "experts": torch.optim.AdamW(model["experts"].parameters(), lr=0.01),
        "dense": torch.optim.AdamW(model["dense"].parameters(), lr=0.01),
    }
    return vmo_cls(model, opts, key_names=list(opts)), opts


def test_veomni_multi_optimizer_everywhere_an_optimizer_is_accepted(tmp_path):
    model = _moe()
    vmo, opts = _veomni(model)
    opts["dense"].param_groups[0]["lr"] = 0.0025  # a scheduler moved the never-stepped leaf's lr
    for p in model["dense"].parameters():
        p.requires_grad_(False)
    _train_expert0(model, opts["experts"])
    assert [name for name, _ in named_leaves(vmo)] == ["experts", "dense"]
    before = IdentitySnapshot(model, list(opts.values()))
    sd = sc.sparse_state_dict(model, vmo)
    before.assert_unchanged(model)
    assert not opts["dense"].state  # nothing invented

    model2 = _moe()
    model2.load_state_dict(model.state_dict())
    vmo2, opts2 = _veomni(model2)
    sc.load_sparse_state_dict(model2, vmo2, sd)
    assert opts2["dense"].param_groups[0]["lr"] == 0.0025
    assert not opts2["dense"].state
    assert _state_fqns(model2, list(opts2.values())) == {"experts.0.weight", "experts.0.bias"}

    state = sc.SparseOptimizerState(model2, vmo2)  # accepted at construction, saves through DCP
    import torch.distributed.checkpoint as dcp

    dcp.save({"optim": state}, checkpoint_id=str(tmp_path / "c"))
    model3 = _moe()
    vmo3, opts3 = _veomni(model3)
    dcp.load(
        {"optim": sc.SparseOptimizerState(model3, vmo3)},
        checkpoint_id=str(tmp_path / "c"),
        planner=sc.SparseLoadPlanner(),
    )
    assert opts3["dense"].param_groups[0]["lr"] == 0.0025 and not opts3["dense"].state
    mo = sc.MultiOptimizer(model3, vmo3)
    assert mo.keys() == ["experts", "dense"] and mo["dense"] is opts3["dense"]


def test_veomni_key_names_must_cover_the_dict():
    model = _moe()
    vmo, _opts = _veomni(model)
    vmo.key_names = ["experts"]
    with pytest.raises(ValueError, match=r"optimizers_dict has \['dense'\], which key_names does not list"):
        sc.sparse_state_dict(model, vmo)
    vmo.key_names = ["experts", "dense", "gate"]
    with pytest.raises(ValueError, match=r"key_names lists \['gate'\], which optimizers_dict lacks"):
        sc.SparseOptimizerState(model, vmo)


# ------------------------------------------------------------------------------------- torchtitan
def _titan(model_parts: list[nn.Module], lr: float = 0.01):
    container_cls = _real("torchtitan.components.optimizer", "OptimizersContainer")
    group_cls = _real("torchtitan.components.optimizer.optimizer", "ParamGroupConfig")
    config = container_cls.Config(
        param_groups=[
            group_cls(pattern=r"dense", optimizer_name="Adam", optimizer_kwargs={"lr": lr}),
            group_cls(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": lr, "weight_decay": 0.1}),
        ],
        implementation="for-loop",
    )
    return config.build(model_parts=model_parts)


def test_torchtitan_container_and_model_parts():
    torch.manual_seed(0)
    parts = [
        nn.ModuleDict({"dense": nn.Linear(3, 3), "experts": nn.ModuleList(nn.Linear(3, 3) for _ in range(2))}),
        nn.ModuleDict({"out_dense": nn.Linear(3, 3), "head": nn.Linear(3, 3)}),
    ]
    container = _titan(parts)
    names = [name for name, _ in named_leaves(container)]
    assert names == [f"optim{i}" for i in range(len(container.optimizers))] and len(names) == 4
    container.optimizers[0].param_groups[0]["lr"] = 0.0025  # part 0's Adam group: never steps
    for _ in range(2):
        container.zero_grad()
        parts[1]["head"](parts[0]["experts"][0](torch.randn(4, 3))).sum().backward()
        container.step()
    before = IdentitySnapshot(parts[0], list(container.optimizers))
    sd = sc.sparse_state_dict(parts, container)
    before.assert_unchanged(parts[0])
    assert not container.optimizers[0].state  # torchtitan's own state_dict would have invented it

    parts2 = [
        nn.ModuleDict({"dense": nn.Linear(3, 3), "experts": nn.ModuleList(nn.Linear(3, 3) for _ in range(2))}),
        nn.ModuleDict({"out_dense": nn.Linear(3, 3), "head": nn.Linear(3, 3)}),
    ]
    for a, b in zip(parts, parts2):
        b.load_state_dict(a.state_dict())
    container2 = _titan(parts2)
    sc.load_sparse_state_dict(parts2, container2, sd)
    assert container2.optimizers[0].param_groups[0]["lr"] == 0.0025
    assert not container2.optimizers[0].state
    for a, b in zip(container.optimizers, container2.optimizers):
        assert len(a.state) == len(b.state)
        for p, q in zip(
            (p for g in a.param_groups for p in g["params"]), (q for g in b.param_groups for q in g["params"])
        ):
            assert a.state.get(p, {}).keys() == b.state.get(q, {}).keys()
    sc.SparseOptimizerState(parts2, container2)  # accepted at construction


# ------------------------------------------------------------------------------------- Accelerate
def test_accelerated_optimizer_is_its_optimizer():
    accelerator_cls = _real("accelerate", "Accelerator")
    model = _moe()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    accelerator = accelerator_cls(cpu=True)
    model, wrapped = accelerator.prepare(model, opt)
    assert type(wrapped).__name__ == "AcceleratedOptimizer"
    assert named_leaves(wrapped) == [("optim", opt)]
    _train_expert0(model, wrapped)
    sd = sc.sparse_state_dict(model, wrapped)
    assert sd.keys() == sc.sparse_state_dict(model, opt).keys()  # the same checkpoint as the plain optimizer's
    model2 = _moe()
    plain = torch.optim.AdamW(model2.parameters(), lr=0.01)
    sc.load_sparse_state_dict(model2, plain, sd)
    assert _state_fqns(model2, [plain]) == {"experts.0.weight", "experts.0.bias", "dense.weight", "dense.bias"}
    assert sc.MultiOptimizer(model, {"all": wrapped})["all"] is opt


# ------------------------------------------------------------------------ rules, with stand-ins
class _Lookahead(torch.optim.Optimizer):
    """A wrapper with state of its own (slow weights): not a thin wrapper, never unwrapped."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = {}  # its own
        self.defaults = optimizer.defaults

    def state_dict(self):  # pragma: no cover - never called by sparse_ckpt
        return {"inner": self.optimizer.state_dict(), "slow": self.state}


class _Holder(torch.optim.Optimizer):
    """An unknown container: holds optimizers, overrides state_dict."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.parts = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = {}
        self.defaults = {}

    def state_dict(self):  # pragma: no cover - never called by sparse_ckpt
        return {}


def test_a_wrapper_with_state_of_its_own_is_not_unwrapped():
    model = _moe()
    inner = torch.optim.AdamW(model.parameters())
    wrapper = _Lookahead(inner)
    assert named_leaves(wrapper) == [("optim", wrapper)]
    with pytest.raises(UnsupportedStateDictError) as err:
        sc.SparseOptimizerState(model, wrapper)  # refused at construction
    assert "`.optimizer` (a AdamW)" in str(err.value) and "register an adapter" in str(err.value)


def test_unknown_containers_are_told_what_to_pass():
    model = _moe()
    holder = _Holder(
        [torch.optim.SGD(model["experts"].parameters(), lr=0.1), torch.optim.SGD(model["dense"].parameters())]
    )
    with pytest.raises(UnsupportedStateDictError, match=r"holds optimizer\(s\) at `.parts` \(a list of 2 optimizers\)"):
        sc.sparse_state_dict(model, holder)
    with pytest.raises(UnsupportedStateDictError, match=r"`.parts`"):
        sc.SparseOptimizerState(model, holder)

    class Box:
        def __init__(self, opt):
            self.opt = opt

    with pytest.raises(TypeError, match=r"got Box; it holds optimizer\(s\) at `.opt` \(a SGD\)"):
        sc.SparseOptimizerState(model, Box(holder.parts[0]))
    with pytest.raises(TypeError, match=r"got Box; it holds"):
        sc.load_sparse_state_dict(model, Box(holder.parts[0]), {})
    with pytest.raises(TypeError, match="container of several optimizers"):
        named_leaves({"a": {"b": holder.parts[0]}})


def test_model_parts():
    a = nn.ModuleDict({"x": nn.Linear(2, 2)})
    b = nn.ModuleDict({"y": nn.Linear(2, 2)})
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1, momentum=0.9)
    (a["x"](torch.randn(1, 2)).sum() + b["y"](torch.randn(1, 2)).sum()).backward()
    opt.step()
    sd = sc.sparse_state_dict([a, b], opt)
    assert {k for k in sd if is_state_item(k)} == {
        f"state.{n}.momentum_buffer" for n in ("x.weight", "x.bias", "y.weight", "y.bias")
    }
    opt2 = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.5, momentum=0.9)
    sc.load_sparse_state_dict((a, b), opt2, sd)
    assert opt2.param_groups[0]["lr"] == 0.1 and len(opt2.state) == 4
    twin = nn.ModuleDict({"x": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"'x.weight' is in model part 0 and model part 1"):
        sc.sparse_state_dict([a, twin], opt)
    with pytest.raises(ValueError, match=r"'x.weight' is in model part 0 and model part 1"):
        sc.SparseOptimizerState([a, twin], opt)  # at construction, not at the first save
    with pytest.raises(ValueError, match=r"'x.weight' is in model part 0 and model part 1"):
        sc.MultiOptimizer([a, twin], {"o": opt})
    with pytest.raises(TypeError, match="model part 1 is a str"):
        sc.SparseOptimizerState([a, "b"], opt)
    with pytest.raises(TypeError, match="model must be an nn.Module or a list of nn.Module"):
        sc.sparse_state_dict({"a": a}, opt)
    with pytest.raises(TypeError, match="empty list"):
        sc.MultiOptimizer([], {"o": opt})


def test_one_parameter_in_two_parts_is_one_parameter():
    shared = nn.Linear(2, 2)
    a, b = nn.ModuleDict({"emb": shared}), nn.ModuleDict({"head": shared})
    opt = torch.optim.SGD(shared.parameters(), lr=0.1, momentum=0.9)
    shared(torch.randn(1, 2)).sum().backward()
    opt.step()
    sd = sc.sparse_state_dict([a, b], opt)
    assert {k for k in sd if is_state_item(k)} == {"state.emb.weight.momentum_buffer", "state.emb.bias.momentum_buffer"}
    opt2 = torch.optim.SGD(shared.parameters(), lr=0.1, momentum=0.9)
    sc.load_sparse_state_dict([b, a], opt2, sd)  # the alias head.* resolves to the saved emb.*
    assert len(opt2.state) == 2


# ------------------------------------------------------------------------------------- adapters
class _InventingAdam(torch.optim.AdamW):
    def state_dict(self):  # pragma: no cover - adapter below is what runs
        return super().state_dict()


def _synthetic_step(opt: torch.optim.Optimizer) -> dict:
    """What torch DSD's get_optimizer_state_dict does to an optimizer without state."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None
    return torch.optim.Optimizer.state_dict(opt)


def test_an_adapter_that_changes_the_live_optimizer_is_refused():
    model = _moe()
    opt = _InventingAdam(model.parameters(), lr=0.01)
    with (
        sc.register_state_dict_adapter(_InventingAdam, _synthetic_step),
        pytest.raises(UnsupportedStateDictError, match=r"changed the live _InventingAdam \(its state \(0 -> 8"),
    ):
        sc.sparse_state_dict(model, opt)

    def bump(o):
        for s in o.state.values():
            s["exp_avg"].add_(1.0)
        return torch.optim.Optimizer.state_dict(o)

    with (
        sc.register_state_dict_adapter(_InventingAdam, bump),
        pytest.raises(UnsupportedStateDictError, match=r"\(its state values\)"),
    ):
        sc.sparse_state_dict(model, opt)

    def reader(o):
        return torch.optim.Optimizer.state_dict(o)

    with sc.register_state_dict_adapter(_InventingAdam, reader):
        assert sc.sparse_state_dict(model, opt)  # an adapter that only reads is fine
