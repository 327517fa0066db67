"""``state_layout="buffers"`` against damaged metadata and DCP's save-plan caching:

* an empty buffer item (``.metadata`` says size ``(0,)``, or a dict whose buffer is
  ``torch.empty(0)`` saved through DCP) is refused: DCP never hands an empty item to a reader, so
  every buffer the plan needs must have been consumed;
* a buffer item whose ``storage_data`` entry is gone is refused by name, not a raw ``KeyError``;
* bucket keys name their dtype, so ``DefaultSavePlanner(enable_plan_caching=True)`` cannot write a
  bucket of another dtype under the cached metadata of the last save.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, make_moe, snapshot_optimizer, train
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _source() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_moe(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 2, only_experts=[0, 2])
    return model, opt


def _refused(model: nn.Module, path: Path, exc: type[Exception], match: str) -> None:
    model2 = make_moe(1)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    train(model2, opt2, 1, only_experts=[1], seed=9)
    before = snapshot_optimizer(opt2)
    with pytest.raises(exc, match=match):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, opt2, state_layout="buffers")},
            checkpoint_id=path,
            planner=sc.SparseLoadPlanner(),
        )
    assert_optimizer_equal(opt2, before)


def _edit_metadata(path: Path, edit: Any) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _buffer_key(path: Path) -> str:
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return next(k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}optim.B"))


def test_a_buffer_the_metadata_calls_empty_is_refused(tmp_path: Path) -> None:
    model, opt = _source()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout="buffers")}, checkpoint_id=tmp_path)
    key = _buffer_key(tmp_path)

    def empty(md: Any) -> None:
        item = md.state_dict_metadata[key]
        item.size = torch.Size([0])
        for chunk in item.chunks:
            chunk.sizes = torch.Size([0])

    _edit_metadata(tmp_path, empty)
    inner = key.removeprefix("optim.")
    _refused(
        model,
        tmp_path,
        sc.CheckpointFormatError,
        rf"leaf 'optim': buffer item '{inner}', which holds state 'exp_avg' of '[\w.]+' .*the checkpoint holds "
        "it empty or not at all",
    )


def test_an_empty_buffer_saved_through_dcp_is_refused(tmp_path: Path) -> None:
    model, opt = _source()
    sd = sc.sparse_state_dict(model, opt, state_layout="buffers")
    key = next(k for k in sd if k.startswith(f"{BUFFERS_PREFIX}optim.B"))
    sd[key] = torch.empty(0)
    dcp.save({"optim": sd}, checkpoint_id=tmp_path)
    _refused(model, tmp_path, sc.CheckpointFormatError, rf"leaf 'optim': buffer item '{key}', which holds state")


def test_a_buffer_without_its_storage_entry_is_refused_by_name(tmp_path: Path) -> None:
    model, opt = _source()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout="buffers")}, checkpoint_id=tmp_path)
    key = _buffer_key(tmp_path)

    def lose_storage(md: Any) -> None:
        for index in [i for i in md.storage_data if i.fqn == key]:
            del md.storage_data[index]

    _edit_metadata(tmp_path, lose_storage)
    _refused(model, tmp_path, sc.CheckpointMismatchError, rf"checkpoint item '{key}' has no storage entry")


def test_plan_caching_cannot_reuse_a_bucket_key_for_another_dtype(tmp_path: Path) -> None:
    """Save 1: state only for an fp32 4x4 parameter; before save 2 that state goes and a bf16 4x4
    parameter steps. Same bucket index, rank set and size: the key must still differ, else DCP's
    cached plan (which does not compare dtypes) writes save 2 with save 1's float32 metadata."""
    model = nn.ParameterDict(
        {"a": nn.Parameter(torch.ones(4, 4)), "b": nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))}
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model["a"].grad = torch.full((4, 4), 0.5)
    opt.step()
    state = sc.SparseOptimizerState(model, opt, state_layout="buffers")
    dcp.save({"optim": state}, checkpoint_id=tmp_path / "1", planner=DefaultSavePlanner(enable_plan_caching=True))
    del opt.state[model["a"]]
    model["a"].grad = None
    model["b"].grad = torch.full((4, 4), 0.25, dtype=torch.bfloat16)
    opt.step()
    dcp.save({"optim": state}, checkpoint_id=tmp_path / "2", planner=DefaultSavePlanner(enable_plan_caching=True))
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    dcp.load(
        {"optim": sc.SparseOptimizerState(model, fresh, state_layout="buffers")},
        checkpoint_id=tmp_path / "2",
        planner=sc.SparseLoadPlanner(),
    )
    assert_optimizer_equal(fresh, opt)
    keys = dcp.FileSystemReader(str(tmp_path / "2")).read_metadata().state_dict_metadata
    assert [k.rpartition(".")[2] for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}optim.B")] == [
        "B0_bfloat16_w1r0"
    ]


def test_tools_refuse_overlapping_layouts() -> None:
    """What ``verify``/``inspect`` read (``layout_view``): rows [0,6) and [4,8) of a 10x2 state
    have as many elements as the tensor, and overlap; refused like a load refuses them."""
    from sparse_ckpt import _backend
    from sparse_ckpt._format.keys import seal
    from sparse_ckpt._layouts import bucketed, bucketed_view

    values: dict[str, Any] = {}
    for rank, (lo, hi) in enumerate([(0, 6), (4, 8)]):
        entry = ("p", "exp_avg", "float32", 4, (10, 2), (lo, 0), (hi - lo, 2))
        table, _buckets = _backend.core.encode_layout("optim", [entry], 1 << 20)
        values[bucketed.layout_key("optim", f"w2r{rank}")] = seal(table)
        values[bucketed.buffer_key("optim", f"w2r{rank}", 0, "float32")] = torch.zeros(2 * (hi - lo))
    with pytest.raises(
        sc.CheckpointMismatchError, match=r"leaf 'optim': state 'exp_avg' of 'p': the checkpoint's layouts overlap"
    ):
        bucketed_view.layout_view(list(values), values)
    with pytest.raises(sc.CheckpointMismatchError, match="layouts overlap"):
        bucketed_view.full_state(list(values), values)
