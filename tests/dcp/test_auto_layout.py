"""``state_layout="auto"``, the default of the DCP ``Stateful``s, in one process: which state tensors
are items of their own (those of at least ``AUTO_OWN_ITEM_BYTES``, uncopied) and which are buffered,
exact round trips in every direction between the three layouts, and the tools' view.

Multi-rank (FSDP2 chunks decided alike on every rank, 2 -> 1, 2 -> 4, expert parallelism):
tests/dcp/test_buffers_multirank.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_optimizer_equal, make_moe, train
from torch import nn

import sparse_ckpt as sc
import sparse_ckpt._layouts as layouts
from sparse_ckpt import tools
from sparse_ckpt._dcp.planner import PLANNER_GUARD_KEY
from sparse_ckpt._format.keys import BUFFERS_PREFIX, STATE_PREFIX

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

LAYOUTS = ("auto", "per_tensor", "buffers")


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_moe(seed, n_experts=4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 2, only_experts=[0, 2])
    return model, opt


def _split(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, set[str], set[str]]:
    """A threshold between the state tensors' sizes, and the ``fqn.key`` of those at or above it
    (items of their own) and below it (buffered)."""
    names = {id(p): n for n, p in model.named_parameters()}
    sizes = {
        f"{names[id(p)]}.{k}": v.numel() * v.element_size()
        for p, st in opt.state.items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor) and v.shape == p.shape and p.ndim > 0
    }
    threshold = sorted(set(sizes.values()))[len(set(sizes.values())) // 2]
    big = {k for k, n in sizes.items() if n >= threshold}
    assert big and len(big) < len(sizes)  # the fixture has both kinds
    return threshold, big, set(sizes) - big


@pytest.fixture
def threshold(monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_to(n: int) -> None:
        monkeypatch.setattr(layouts, "AUTO_OWN_ITEM_BYTES", n)

    return set_to


def test_auto_is_the_default_and_splits_by_size(threshold: Any) -> None:
    model, opt = _trained()
    limit, big, small = _split(model, opt)
    threshold(limit)  # a tensor of exactly the threshold is an item of its own
    state = sc.SparseOptimizerState(model, opt)
    assert state.state_layout == "auto" and sc.MultiOptimizer(model, {"o": opt}).state_layout == "auto"
    assert sc.sparse_state_dict(model, opt).keys() == sc.sparse_state_dict(model, opt, state_layout="per_tensor").keys()
    sd = state.state_dict()
    per_item = {k[len(STATE_PREFIX) :] for k in sd if k.startswith(STATE_PREFIX) and not k.startswith(BUFFERS_PREFIX)}
    assert big <= per_item and not small & per_item
    params = dict(model.named_parameters())
    for name in big:  # no copy: the live state tensor itself, as per_tensor writes it
        fqn, key = name.rsplit(".", 1)
        assert sd[f"{STATE_PREFIX}{name}"] is opt.state[params[fqn]][key]
    buffers = [k for k in sd if k.startswith(BUFFERS_PREFIX)]
    assert len(buffers) == 2  # one layout table and one float32 bucket
    numel = sum(opt.state[params[n.rsplit(".", 1)[0]]][n.rsplit(".", 1)[1]].numel() for n in small)
    assert [v.numel() for k, v in sd.items() if k.startswith(BUFFERS_PREFIX) and ".B" in k] == [numel]
    threshold(1 << 62)  # nothing is large enough: all buffered, as "buffers" writes it
    assert (
        sc.SparseOptimizerState(model, opt).state_dict().keys()
        == sc.SparseOptimizerState(model, opt, state_layout="buffers").state_dict().keys()
    )


def test_every_layout_loads_into_every_layout(tmp_path: Path, threshold: Any) -> None:
    """A checkpoint of any layout restores exactly whatever layout the loading state is set to
    (the layout is a save-side choice: old per-tensor and buffers checkpoints keep loading)."""
    model, opt = _trained()
    threshold(_split(model, opt)[0])
    for saved in LAYOUTS:
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=saved)}, checkpoint_id=tmp_path / saved)
    for saved in LAYOUTS:
        for loading in LAYOUTS:
            model2 = make_moe(1, n_experts=4)
            model2.load_state_dict(model.state_dict())
            opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
            dcp.load(
                {"optim": sc.SparseOptimizerState(model2, opt2, state_layout=loading)},
                checkpoint_id=tmp_path / saved,
                planner=sc.SparseLoadPlanner(),
            )
            assert_optimizer_equal(opt2, opt, grads=False)


def test_tools_see_auto_as_per_tensor(tmp_path: Path, threshold: Any) -> None:
    model, opt = _trained()
    threshold(_split(model, opt)[0])
    for layout in ("auto", "per_tensor"):
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path / layout)
    reports = {
        layout: tools.inspect_checkpoint(tmp_path / layout)["optimizers"][0] for layout in ("auto", "per_tensor")
    }
    assert reports["auto"]["items"] < reports["per_tensor"]["items"]
    for r in reports.values():
        for field in ("items", "table_bytes", "disk_bytes"):
            r.pop(field)
    assert reports["auto"] == reports["per_tensor"]
    assert tools.diff_checkpoints(tmp_path / "per_tensor", tmp_path / "auto")["differences"] == 0
    assert tools.verify_checkpoint(tmp_path / "auto")["ok"]


def test_auto_item_counts(tmp_path: Path, threshold: Any) -> None:
    """auto's DCP items: per-item the large tensors, plus one layout and one bucket per dtype."""
    model, opt = _trained()
    limit, big, _small = _split(model, opt)
    threshold(limit)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "c")
    md = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata()
    keys = [k.removeprefix("optim.") for k in md.state_dict_metadata if k != f"optim.{PLANNER_GUARD_KEY}"]
    state = [k for k in keys if k.startswith(STATE_PREFIX) and "__" not in k.split(".")[1]]
    assert sorted(state) == sorted(f"{STATE_PREFIX}{n}" for n in big)
    assert len([k for k in keys if k.startswith(BUFFERS_PREFIX)]) == 2


@pytest.mark.parametrize("layout", ["buffers", "per_tensor"])
def test_items_are_read_straight_into_their_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """A load reads each bucket, and each whole state item of a plain CPU parameter, from its file
    into the tensor it keeps (``torch.load`` of the item's bytes), not through ``read_data`` (which
    loads into one tensor and copies into another); a storage reader of another type still goes
    through ``read_data``."""
    model, opt = _trained()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path / "c")
    through_read_data: list[str] = []
    original = dcp.FileSystemReader.read_data

    def counted(self: Any, plan: Any, planner: Any) -> Any:
        through_read_data.extend(item.dest_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", counted)

    class OwnReader(dcp.FileSystemReader):
        pass

    for reader, direct in ((dcp.FileSystemReader(str(tmp_path / "c")), True), (OwnReader(str(tmp_path / "c")), False)):
        through_read_data.clear()
        model2 = make_moe(1, n_experts=4)
        model2.load_state_dict(model.state_dict())
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, opt2)}, storage_reader=reader, planner=sc.SparseLoadPlanner()
        )
        assert_optimizer_equal(opt2, opt, grads=False)
        tensors = [
            k
            for k in through_read_data
            if (k.startswith(f"optim.{BUFFERS_PREFIX}") and ".B" in k)
            or (k.startswith(f"optim.{STATE_PREFIX}") and "__" not in k)
        ]
        assert (not tensors) if direct else tensors, through_read_data


def test_async_save_buffers_fewer_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``dcp.async_save`` (which copies the whole dict before it returns) ``auto`` keeps the
    tensors of at least ``AUTO_ASYNC_OWN_ITEM_BYTES`` per item, uncopied; ``dcp.save`` buffers the
    ones below ``AUTO_OWN_ITEM_BYTES``. Both checkpoints restore exactly."""
    model, opt = _trained()
    limit, big, small = _split(model, opt)
    monkeypatch.setattr(layouts, "AUTO_OWN_ITEM_BYTES", 1 << 62)  # a blocking save buffers everything
    monkeypatch.setattr(layouts, "AUTO_ASYNC_OWN_ITEM_BYTES", limit)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "sync")
    dcp.async_save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "async").result()
    per_item = {}
    for name in ("sync", "async"):
        md = dcp.FileSystemReader(str(tmp_path / name)).read_metadata()
        keys = [k.removeprefix("optim.") for k in md.state_dict_metadata]
        per_item[name] = {
            k[len(STATE_PREFIX) :] for k in keys if k.startswith(STATE_PREFIX) and "__" not in k.split(".")[1]
        }
    assert per_item["sync"] == set() and per_item["async"] == big and not small & per_item["async"]
    for name in ("sync", "async"):
        model2 = make_moe(1, n_experts=4)
        model2.load_state_dict(model.state_dict())
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, opt2)},
            checkpoint_id=tmp_path / name,
            planner=sc.SparseLoadPlanner(),
        )
        assert_optimizer_equal(opt2, opt, grads=False)
