"""Zero-element DTensor parameters in the ``buffers`` layout (one-process Gloo group, 1-rank CPU mesh):
their state round-trips with the parameter's shape and placements and torch's strides, and the one
stride rule (torch's contiguous strides, a dimension of 0 counted as 1) is what both a buffered load
and the direct reads of saved tensors use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import sparse_ckpt as sc
from sparse_ckpt._dcp.saved_tensor import contiguous_strides
from sparse_ckpt._fqn import build_fqn_map
from sparse_ckpt._layouts import bucketed_scatter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SHAPES = [(4, 0), (0, 3), (2, 0, 3), (3, 2)]


def _model(mesh: object, placement: object) -> nn.Module:
    """One DTensor parameter per shape of :data:`SHAPES` (all but the last have no elements)."""
    model = nn.Module()
    for i, shape in enumerate(SHAPES):
        data = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        model.register_parameter(f"p{i}", nn.Parameter(distribute_tensor(data, mesh, [placement])))
    return model


def _trained(mesh: object, placement: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(mesh, placement)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


def _assert_state_like_saved(dst: torch.optim.Optimizer, src: torch.optim.Optimizer, model: nn.Module) -> None:
    for p in model.parameters():
        assert set(dst.state[p]) == set(src.state[p])
        for key in ("exp_avg", "exp_avg_sq"):
            got, saved = dst.state[p][key], src.state[p][key]
            assert isinstance(got, DTensor) and got.placements == p.placements
            assert got.shape == p.shape and got.stride() == torch.empty(p.shape).stride() == saved.stride()
            assert torch.equal(got.full_tensor(), saved.full_tensor())


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=["shard", "replicate"])
def test_zero_element_dtensor_state_round_trips_in_memory(mesh: object, placement: object) -> None:
    """``sparse_state_dict(state_layout="buffers")`` then ``load_sparse_state_dict``: the state of
    zero-element DTensor parameters (an empty local shard) comes back as DTensors with the
    parameter's shape, placements and torch's strides, next to a non-empty one made from its bucket."""
    model, src = _trained(mesh, placement)
    sd = sc.sparse_state_dict(model, src, state_layout="buffers")
    dst = torch.optim.AdamW(model.parameters(), lr=0.01)
    sc.load_sparse_state_dict(model, dst, sd)
    _assert_state_like_saved(dst, src, model)


def test_zero_element_dtensor_state_round_trips_through_dcp(mesh: object, tmp_path: Path) -> None:
    """The same through ``dcp.save``/``dcp.load`` of a ``SparseOptimizerState`` in the buffers layout."""
    model, src = _trained(mesh, Shard(0))
    dcp.save({"optim": sc.SparseOptimizerState(model, src, state_layout="buffers")}, checkpoint_id=tmp_path)
    dst = torch.optim.AdamW(model.parameters(), lr=0.01)
    dcp.load({"optim": sc.SparseOptimizerState(model, dst)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner())
    _assert_state_like_saved(dst, src, model)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_bucket_view_of_a_dtensor_has_torchs_strides(mesh: object, shape: tuple[int, ...]) -> None:
    """A whole chunk made the state tensor of a DTensor parameter (the view path of a buffered load)
    gets the strides torch gives a new tensor of the global shape, zero-sized dimensions included."""
    model = _model(mesh, Shard(0))
    fqn = f"p{SHAPES.index(shape)}"
    local = torch.empty(getattr(model, fqn).to_local().shape)
    view = bucketed_scatter._wrap(
        local, (fqn, "exp_avg", "float32", shape, (0,) * len(shape), shape), build_fqn_map(model)
    )
    assert isinstance(view, DTensor) and view.shape == torch.Size(shape)
    assert view.stride() == torch.empty(shape).stride()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=5))
def test_contiguous_strides_are_torchs(size: list[int]) -> None:
    """`contiguous_strides` is ``torch.empty(size).stride()`` for every size, zeros included."""
    assert contiguous_strides(tuple(size)) == torch.empty(size).stride()
