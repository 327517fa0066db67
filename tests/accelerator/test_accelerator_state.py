"""Optimizer state on an accelerator: exact save and restore where the state lives on the device.

Parametrised over the accelerator types present (``device_type``: ``cuda`` where CUDA is available,
``npu`` where an ``npu`` device type is registered -- Ascend's ``torch_npu``, or the emulated device
of ``.ci/npu.sh``; each skipped elsewhere, with the reason: tests/accelerator/accelerators.py);
``bench/device_check.sh`` runs it on a GPU or NPU machine. For fused and capturable optimizers and
the usual ones (AdamW fused and capturable; Adam foreach, for-loop, amsgrad, capturable with a
tensor lr; SGD fused; RMSprop; NAdam capturable; RAdam; Adamax), fp32 and bf16 parameters, through
the dict path (``sparse_state_dict`` / ``load_sparse_state_dict``) and the DCP path
(``SparseOptimizerState`` + ``SparseLoadPlanner``), on both core backends: a trained MoE (two
experts never routed: no state) is saved, restored into a fresh model and MultiOptimizer, and must
equal the source exactly -- values, dtypes, devices (``step`` where torch puts it: on the
parameter's device, float32, for fused and capturable optimizers, else on the CPU), settings -- and
so must the next step.

``SPARSE_CKPT_TEST_DEVICE=cpu`` runs the module on the CPU instead (capturable cases skipped: torch
supports them on accelerators only), to check the module itself on a machine without an
accelerator; the dry run of ``bench/device_check.sh --device cpu`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, clone_state_dict
from torch import nn

import sparse_ckpt as sc

ROUTED = (0, 1)
"""Experts that get tokens; experts 2 and 3 never get a gradient, so they must never get state."""

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, tuple[OptimizerFactory, bool]] = {
    # name: (factory, capturable -- needs an accelerator)
    "adamw-fused": (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True), False),
    "adamw-capturable": (lambda ps: torch.optim.AdamW(ps, lr=0.01, capturable=True), True),
    "adam-foreach": (lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True), False),
    "adam-for-loop": (lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), False),
    "adam-amsgrad": (lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True), False),
    "adam-capturable-tensor-lr": (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), capturable=True), True),
    "sgd-fused": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), False),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9), False),
    "nadam-capturable": (lambda ps: torch.optim.NAdam(ps, lr=0.01, capturable=True), True),
    "radam": (lambda ps: torch.optim.RAdam(ps, lr=0.01), False),
    "adamax": (lambda ps: torch.optim.Adamax(ps, lr=0.01), False),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NEXT_STEP_NOT_REPRODUCIBLE = {("sgd-fused", torch.bfloat16, "cpu")}
"""Where torch itself does not repeat a step after a restore: fused SGD on bf16 CPU parameters (torch 2.13)
gives momentum buffers that differ in the last bit after ``load_state_dict(deepcopy(state_dict()))`` --
torch's own round trip -- and from run to run of the same restore (it depends on where the buffers are
allocated). The restored state is still compared exactly; only the next step is not. The emulated npu
device (.ci/npu.sh) runs the CPU kernels, so the same holds there (:func:`kernels_of`)."""


TORCH_CASTS = {("nadam-capturable", torch.bfloat16)}
"""Where torch's own ``load_state_dict`` changes a value's dtype, so no restore that follows torch's cast
policy (the contract) equals the source: NAdam's 0-dim float32 ``mu_product`` becomes bf16 like its
parameter (torch 2.13, ``Optimizer._process_value_according_to_param_policy``). There the restore must
equal torch's own restore exactly (checked), and the next step is not compared with the source's."""


def kernels_of(device: torch.device) -> str:
    """Whose kernels run on ``device``: ``cpu`` for the CPU and for the emulated npu (its kernels are the
    CPU's, tests/accelerator/emulated_npu.py), else the device type."""
    module = torch.get_device_module(device.type) if device.type != "cpu" else None
    return "cpu" if module is None or getattr(module, "emulated", False) else device.type


@pytest.fixture(params=list(OPTIMIZERS))
def optimizer_name(request: pytest.FixtureRequest, device_type: str) -> str:
    name = request.param
    if OPTIMIZERS[name][1] and device_type == "cpu":
        pytest.skip("capturable optimizers need an accelerator")
    return name


@pytest.fixture(params=list(DTYPES))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return DTYPES[request.param]


class Net(nn.Module):
    """``embed -> experts -> norm -> head``; the rows go to the experts in :data:`ROUTED`, the others get none."""

    def __init__(self, dim: int = 8, n_experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim, bias=False))
            for _ in range(n_experts)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        routed = torch.cat([self.experts[e](rows) for e, rows in zip(ROUTED, h.chunk(len(ROUTED)))])
        return self.head(self.norm(h + routed))


def build(seed: int, name: str, dtype: torch.dtype, device: str) -> tuple[Net, sc.MultiOptimizer]:
    """A :class:`Net` on ``device`` in ``dtype`` (its values set by ``seed``), with leaves ``experts``
    and ``dense``, each an optimizer ``name``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Net().to(device=device, dtype=dtype)
    make = OPTIMIZERS[name][0]
    expert_ids = {id(p) for p in model.experts.parameters()}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    return model, sc.MultiOptimizer(model, {"experts": make(model.experts.parameters()), "dense": make(dense)})


def train(model: Net, opt: sc.MultiOptimizer, steps: int, seed: int) -> None:
    """``steps`` deterministic steps (the batches drawn on the CPU); only experts :data:`ROUTED` get rows."""
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + i)).to(device=device, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()


def trained(name: str, dtype: torch.dtype, device: str) -> tuple[Net, sc.MultiOptimizer]:
    model, opt = build(0, name, dtype, device)
    train(model, opt, 2, seed=0)
    return model, opt


def fresh_copy(model: Net, name: str, dtype: torch.dtype) -> tuple[Net, sc.MultiOptimizer]:
    """Another model (other initial values) and MultiOptimizer, its weights then loaded from ``model``."""
    model2, opt2 = build(1, name, dtype, str(next(model.parameters()).device))
    model2.load_state_dict(model.state_dict())
    return model2, opt2


def assert_placed_as_torch_places(model: Net, opt: sc.MultiOptimizer) -> None:
    """State on its parameter's device; ``step`` float32 on the parameter's device for fused and capturable
    optimizers, else on the CPU (torch's placement); no state for the experts that never got a token."""
    unrouted = {id(p) for e, expert in enumerate(model.experts) if e not in ROUTED for p in expert.parameters()}
    n = 0
    for leaf, o in opt.leaves():
        for group in o.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                st = o.state.get(p)
                if id(p) in unrouted:
                    assert not st, f"leaf {leaf!r}: an unrouted expert got state {sorted(st or {})}"
                    continue
                assert st, f"leaf {leaf!r}: a routed parameter has no state"
                for key, value in st.items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    if key == "step":
                        want = p.device if on_device else torch.device("cpu")
                        assert value.device == want, f"leaf {leaf!r}: step on {value.device}, torch puts it on {want}"
                        if on_device:
                            assert value.dtype == torch.float32
                    elif value.dim() > 0:
                        assert value.device == p.device, f"leaf {leaf!r}: {key} on {value.device}, param on {p.device}"
                n += 1
    assert n > 0


def assert_restored_exactly(
    model: Net, opt: sc.MultiOptimizer, model2: Net, opt2: sc.MultiOptimizer, name: str, dtype: torch.dtype
) -> None:
    """``opt2`` equals ``opt`` exactly (and equals what torch's own ``load_state_dict`` gives), and the next
    step of both is identical."""
    if (name, dtype) not in TORCH_CASTS:
        assert_optimizer_equal(opt, opt2, grads=False)
    assert_placed_as_torch_places(model2, opt2)
    _model3, opt3 = fresh_copy(model, name, dtype)
    for leaf, o in opt.leaves():
        opt3[leaf].load_state_dict(copy.deepcopy(o.state_dict()))  # torch's own restore: the placement to match
    assert_optimizer_equal(opt3, opt2, grads=False)
    if (name, dtype) in TORCH_CASTS or (
        name,
        dtype,
        kernels_of(next(model.parameters()).device),
    ) in NEXT_STEP_NOT_REPRODUCIBLE:
        return
    train(model, opt, 1, seed=50)
    train(model2, opt2, 1, seed=50)
    assert_optimizer_equal(opt, opt2, grads=False)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)


def test_dict_path(optimizer_name: str, dtype: torch.dtype, device_type: str) -> None:
    """A state dict of device state restores exactly (values, dtypes, devices, next step)."""
    model, opt = trained(optimizer_name, dtype, device_type)
    assert_placed_as_torch_places(model, opt)
    sd = clone_state_dict(sc.sparse_state_dict(model, opt))  # (what a round trip through storage gives)
    model2, opt2 = fresh_copy(model, optimizer_name, dtype)
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert_restored_exactly(model, opt, model2, opt2, optimizer_name, dtype)


def test_dict_path_from_host_memory(optimizer_name: str, dtype: torch.dtype, device_type: str) -> None:
    """The dict with every tensor moved to the CPU (as ``torch.load(map_location="cpu")`` gives it) restores
    onto the device exactly."""
    model, opt = trained(optimizer_name, dtype, device_type)
    sd = {
        k: v.cpu() if isinstance(v, torch.Tensor) else v
        for k, v in clone_state_dict(sc.sparse_state_dict(model, opt)).items()
    }
    model2, opt2 = fresh_copy(model, optimizer_name, dtype)
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert_restored_exactly(model, opt, model2, opt2, optimizer_name, dtype)


def test_dcp_path(optimizer_name: str, dtype: torch.dtype, device_type: str, tmp_path: Path) -> None:
    """A DCP checkpoint of device state restores exactly into a fresh model and optimizer on the device."""
    model, opt = trained(optimizer_name, dtype, device_type)
    dcp.save(
        {"model": model.state_dict(), "optim": sc.SparseOptimizerState(model, opt)},
        checkpoint_id=tmp_path,
        no_dist=True,
    )
    model2, opt2 = build(1, optimizer_name, dtype, device_type)
    msd = model2.state_dict()
    dcp.load(
        {"model": msd, "optim": sc.SparseOptimizerState(model2, opt2)},
        checkpoint_id=tmp_path,
        planner=sc.SparseLoadPlanner(),
        no_dist=True,
    )
    model2.load_state_dict(msd)
    assert_restored_exactly(model, opt, model2, opt2, optimizer_name, dtype)
