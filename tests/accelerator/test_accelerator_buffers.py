"""``state_layout="buffers"`` and ``"auto"`` (the default; its threshold lowered here so that the
32x16 weights are items of their own and the rest is buffered), and the flat format, with state on
an accelerator (``device_type``: cuda, npu; each skipped where absent, tests/accelerator/accelerators.py):
buffers are assembled on the state's device one bucket at a time and written from host memory; a
load places every state tensor like its parameter (on the device, on the device index it was
saved from: ``<type>:1`` where the machine has two devices; a DTensor on a device mesh for FSDP2),
equal to the per-tensor load bit for bit, and the next step matches -- for plain, foreach, fused and
capturable AdamW, float32 and bfloat16 parameters.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, clone_state_dict
from torch import nn

import sparse_ckpt as sc
import sparse_ckpt._layouts as layouts

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

AUTO_BYTES = 1024
"""Between the biases (at most 128 bytes) and the 32x16 weights (1 KiB in bfloat16, 2 KiB in float32)."""


@pytest.fixture(autouse=True)
def _auto_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "AUTO_OWN_ITEM_BYTES", AUTO_BYTES)


VARIANTS = {
    "plain": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "capturable": {"capturable": True, "foreach": True},
}


def last_device(device_type: str) -> torch.device:
    """The highest-numbered device of the type (``<type>:1`` on a two-device machine; the CPU dry run: cpu),
    so that a load landing on device 0 instead of the saved index shows."""
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).device_count() - 1)


def _model(dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(device, dtype)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)  # batches drawn on the CPU: the same on every device type
    device = next(model.parameters()).device
    for _ in range(n):
        opt.zero_grad()
        x = torch.randn(4, 16, generator=gen).to(device, next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_device_state_round_trips(variant: str, dtype: torch.dtype, device_type: str, tmp_path: Path) -> None:
    """Every layout (per_tensor, buffers, auto) and the flat format restore device state onto the same device
    index bit for bit, and the next step matches."""
    if variant == "capturable" and device_type == "cpu":
        pytest.skip("capturable optimizers need an accelerator")
    device = last_device(device_type)
    model = _model(dtype, device)
    src = torch.optim.AdamW(model.parameters(), lr=0.01, **VARIANTS[variant])
    _steps(model, src, 2, seed=1)
    loaded = {}
    for layout, fmt in (("per_tensor", "packed"), ("buffers", "packed"), ("auto", "packed"), ("auto", "flat")):
        name = layout if fmt == "packed" else f"{layout}-{fmt}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(
                {"optim": sc.SparseOptimizerState(model, src, format=fmt, state_layout=layout)},
                checkpoint_id=tmp_path / name,
            )
        model2 = _model(dtype, device)
        model2.load_state_dict(model.state_dict())
        dst = torch.optim.AdamW(model2.parameters(), lr=0.5, **VARIANTS[variant])
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, dst, format=fmt)},
            checkpoint_id=tmp_path / name,
            planner=sc.SparseLoadPlanner(),
        )
        for st in dst.state.values():
            for k, v in st.items():
                want = device if k != "step" or variant in ("fused", "capturable") else torch.device("cpu")
                assert v.device == want, (name, k, v.device)
        loaded[name] = (model2, dst)
    assert_optimizer_equal(loaded["buffers"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["auto"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["auto-flat"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["buffers"][1], src, grads=False)
    sd = sc.sparse_state_dict(model, src, state_layout="buffers")  # the dict API: buffers on the host
    buffers = [v for k, v in sd.items() if k.startswith("state.__buffers__.") and isinstance(v, torch.Tensor)]
    assert buffers and all(v.device.type == "cpu" for v in buffers)
    if device_type != "cpu":  # staged in ordinary host memory unless SPARSE_CKPT_PINNED_STAGING asks for pinned
        assert not any(v.is_pinned() for v in buffers)
    for model2, dst in loaded.values():
        _steps(model2, dst, 1, seed=5)
    assert_optimizer_equal(loaded["buffers"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["auto"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["auto-flat"][1], loaded["per_tensor"][1], grads=False)
    model3 = _model(dtype, device)
    model3.load_state_dict(model.state_dict())
    dst3 = torch.optim.AdamW(model3.parameters(), lr=0.5, **VARIANTS[variant])
    sc.load_sparse_state_dict(model3, dst3, clone_state_dict(sd))
    assert_optimizer_equal(dst3, src, grads=False)


@pytest.mark.parametrize("layout", ["buffers", "auto"])
def test_fsdp2_on_a_device_mesh(tmp_path: Path, layout: str, device_type: str) -> None:
    """One rank (NCCL on CUDA, HCCL on NPU, npu_gloo on the emulated npu), FSDP2 on a device mesh: DTensor state
    on the device, loaded exactly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from bench.suite.devices import process_group_backend

    if device_type == "cpu":
        pytest.skip("the CPU FSDP2 cases are tests/dcp (Gloo)")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = "29561" if layout == "buffers" else "29562"  # a fresh store per run
    dist.init_process_group(process_group_backend(device_type), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device_type, (1,))

        def build() -> tuple[nn.Module, Any]:
            model = _model(torch.float32, device_type)
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            return model, sc.MultiOptimizer(
                model, {"optim": torch.optim.AdamW(model.parameters(), lr=0.01)}, state_layout=layout
            )

        model, opt = build()
        _steps(model, opt, 2, seed=3)
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=tmp_path / "ckpt")
        model2, opt2 = build()
        msd = model2.state_dict()
        dcp.load({"model": msd, "optim": opt2}, checkpoint_id=tmp_path / "ckpt", planner=sc.SparseLoadPlanner())
        model2.load_state_dict(msd)
        for st, (p2, st2) in zip(opt["optim"].state.values(), opt2["optim"].state.items()):
            for k, v in st.items():
                v2 = st2[k]
                if k != "step":
                    assert (
                        isinstance(v2, DTensor)
                        and v2.device_mesh == p2.device_mesh
                        and v2.to_local().device.type == device_type
                    )
                    v, v2 = v.to_local(), v2.to_local()
                assert torch.equal(v.cpu(), v2.cpu()), k
        _steps(model, opt, 1, seed=9)
        _steps(model2, opt2, 1, seed=9)
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p.to_local(), p2.to_local())
    finally:
        dist.destroy_process_group()


def test_pinned_staging(device_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SPARSE_CKPT_PINNED_STAGING=1``: a buffered save of device state stages every bucket in pinned host
    memory of the accelerator, and the checkpoint restores onto the device index bit for bit."""
    if device_type == "cpu":
        pytest.skip("pinned staging is for accelerator state")
    monkeypatch.setenv("SPARSE_CKPT_PINNED_STAGING", "1")
    device = last_device(device_type)
    model = _model(torch.float32, device)
    src = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    _steps(model, src, 2, seed=1)
    sd = sc.sparse_state_dict(model, src, state_layout="buffers")
    buffers = [v for k, v in sd.items() if k.startswith("state.__buffers__.") and isinstance(v, torch.Tensor)]
    assert buffers and all(v.device.type == "cpu" and v.is_pinned() for v in buffers)
    dcp.save(
        {"optim": sc.SparseOptimizerState(model, src, state_layout="buffers")}, checkpoint_id=tmp_path, no_dist=True
    )
    model2 = _model(torch.float32, device)
    model2.load_state_dict(model.state_dict())
    dst = torch.optim.AdamW(model2.parameters(), lr=0.5, fused=True)
    dcp.load(
        {"optim": sc.SparseOptimizerState(model2, dst)},
        checkpoint_id=tmp_path,
        planner=sc.SparseLoadPlanner(),
        no_dist=True,
    )
    assert_optimizer_equal(dst, src, grads=False)
    assert all(v.device == device for st in dst.state.values() for v in st.values())
