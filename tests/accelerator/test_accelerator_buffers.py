"""``state_layout="buffers"`` and ``"auto"`` (the default; its threshold lowered here so that the
32x16 weights are items of their own and the rest is buffered) with CUDA state (skipped without a
GPU): buffers are assembled on the
state's device one bucket at a time and written from host memory; a load places every state
tensor like its parameter (on the GPU, a DTensor on a CUDA mesh for FSDP2), equal to the
per-tensor load bit for bit, and the next step matches -- for plain, foreach, fused and
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
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
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


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to("cuda", dtype)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        x = torch.randn(4, 16, device="cuda", generator=gen).to(next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_state_round_trips(variant: str, dtype: torch.dtype, tmp_path: Path) -> None:
    model = _model(dtype)
    src = torch.optim.AdamW(model.parameters(), lr=0.01, **VARIANTS[variant])
    _steps(model, src, 2, seed=1)
    loaded = {}
    for layout in ("per_tensor", "buffers", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"optim": sc.SparseOptimizerState(model, src, state_layout=layout)}, checkpoint_id=tmp_path / layout)
        model2 = _model(dtype)
        model2.load_state_dict(model.state_dict())
        dst = torch.optim.AdamW(model2.parameters(), lr=0.5, **VARIANTS[variant])
        dcp.load({"optim": sc.SparseOptimizerState(model2, dst)}, checkpoint_id=tmp_path / layout,
                 planner=sc.SparseLoadPlanner())
        for st in dst.state.values():
            for k, v in st.items():
                want = "cuda" if k != "step" or variant in ("fused", "capturable") else "cpu"
                assert v.device.type == want, (k, v.device)
        loaded[layout] = (model2, dst)
    assert_optimizer_equal(loaded["buffers"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["auto"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["buffers"][1], src, grads=False)
    sd = sc.sparse_state_dict(model, src, state_layout="buffers")  # the dict API: buffers on the host
    assert all(v.device.type == "cpu" for k, v in sd.items() if k.startswith("state.__buffers__.") and isinstance(v, torch.Tensor))
    for model2, dst in loaded.values():
        _steps(model2, dst, 1, seed=5)
    assert_optimizer_equal(loaded["buffers"][1], loaded["per_tensor"][1], grads=False)
    assert_optimizer_equal(loaded["auto"][1], loaded["per_tensor"][1], grads=False)
    model3 = _model(dtype)
    model3.load_state_dict(model.state_dict())
    dst3 = torch.optim.AdamW(model3.parameters(), lr=0.5, **VARIANTS[variant])
    sc.load_sparse_state_dict(model3, dst3, clone_state_dict(sd))
    assert_optimizer_equal(dst3, src, grads=False)


@pytest.mark.parametrize("layout", ["buffers", "auto"])
def test_fsdp2_on_a_cuda_mesh(tmp_path: Path, layout: str) -> None:
    """One NCCL rank, FSDP2 on a CUDA mesh: DTensor state on the GPU, loaded exactly."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = "29561" if layout == "buffers" else "29562"  # a fresh store per run
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))

        def build() -> tuple[nn.Module, Any]:
            model = _model(torch.float32)
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            return model, sc.MultiOptimizer(model, {"optim": torch.optim.AdamW(model.parameters(), lr=0.01)},
                                            state_layout=layout)

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
                    assert isinstance(v2, DTensor) and v2.device_mesh == p2.device_mesh and v2.to_local().is_cuda
                    v, v2 = v.to_local(), v2.to_local()
                assert torch.equal(v.cpu(), v2.cpu()), k
        _steps(model, opt, 1, seed=9)
        _steps(model2, opt2, 1, seed=9)
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert torch.equal(p.to_local(), p2.to_local())
    finally:
        dist.destroy_process_group()
