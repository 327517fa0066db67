"""Complete or refused: a checkpoint records which state keys each parameter has (its scalar
table's ``~keys``), and a load that cannot find one of them -- lost from the dict, from DCP's
``.metadata`` or from a buffer -- is refused with a CheckpointMismatchError naming leaf, FQN and
key, also with ``strict=False``; the optimizer stays exactly as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _sampling import sample
from helpers import assert_optimizer_equal, experts_and_dense, make_moe, snapshot_optimizer, train
from legacy_checkpoints import drop_from_metadata, legacy
from lost_item_sweep import item_kind
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt._format.keys import BUFFERS_PREFIX, PLANNER_GUARD_KEY, is_foreign_guard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _source(only_experts: tuple[int, ...] = (0, 2)) -> tuple[nn.Module, sc.MultiOptimizer]:
    """The MoE (seed 0) with AdamW experts and SGD-momentum dense layers, 2 steps with ``only_experts`` routed."""
    model = make_moe(0)
    opt = experts_and_dense(
        model,
        lambda params: torch.optim.AdamW(params, lr=0.01),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )
    train(model, opt, 2, only_experts=list(only_experts))
    return model, opt


def _target(model: nn.Module) -> tuple[nn.Module, sc.MultiOptimizer]:
    model2 = make_moe(1)
    model2.load_state_dict(model.state_dict())
    opt2 = sc.MultiOptimizer(
        model2,
        {
            "experts": torch.optim.AdamW(model2.expert_params(), lr=0.5),
            "dense": torch.optim.SGD(model2.dense_params(), lr=0.5, momentum=0.5),
        },
    )
    train(model2, opt2, 1, only_experts=[1], seed=9)  # it has state of its own: a refusal must keep it
    return model2, opt2


def _refused(model: nn.Module, load: Any, match: str) -> None:
    model2, opt2 = _target(model)
    before = {leaf: snapshot_optimizer(o) for leaf, o in opt2.leaves()}
    with pytest.raises(sc.CheckpointMismatchError, match=match):
        load(model2, opt2)
    for leaf, o in opt2.leaves():
        assert_optimizer_equal(o, before[leaf])


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("lost", ["state.experts.2.up.weight.exp_avg_sq", "state.norm.weight.momentum_buffer"])
def test_a_lost_item_is_refused(lost: str, strict: bool) -> None:
    model, opt = _source()
    sd = sc.sparse_state_dict(model, opt)
    assert lost in sd
    del sd[lost]
    fqn, _, key = lost.removeprefix("state.").rpartition(".")
    leaf = "experts" if fqn.startswith("experts.") else "dense"
    _refused(
        model,
        lambda m, o: sc.load_sparse_state_dict(m, o, sd, strict=strict),
        rf"leaf '{leaf}': parameter '{fqn}' has no saved state '{key}'.*strict=False does not change this",
    )


def test_a_lost_nested_item_is_refused() -> None:
    model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model["w"]] = {"ema": {"decay": torch.ones(2), "bias": torch.zeros(2)}, 7: torch.ones(2)}
    sd = sc.sparse_state_dict(model, opt)
    assert {"state.w.ema.decay", "state.w.ema.bias", "state.w.~i7"} <= set(sd)
    for lost in ("state.w.ema.bias", "state.w.~i7"):
        bad = {k: v for k, v in sd.items() if k != lost}
        with pytest.raises(sc.CheckpointMismatchError, match=rf"has no saved state '{lost.removeprefix('state.w.')}'"):
            sc.load_sparse_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1), bad, strict=False)
    dst = torch.optim.SGD(model.parameters(), lr=0.1)
    sc.load_sparse_state_dict(model, dst, sd)
    assert list(dst.state[model["w"]]) == ["ema", 7] and list(dst.state[model["w"]]["ema"]) == ["decay", "bias"]


def test_a_key_utf8_cannot_encode_is_recorded_too() -> None:
    model = nn.ParameterDict({"w": nn.Parameter(torch.ones(2))})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model["w"]] = {"\ud800": torch.ones(2), "ok": torch.zeros(2)}
    sd = sc.sparse_state_dict(model, opt)
    dst = torch.optim.SGD(model.parameters(), lr=0.1)
    sc.load_sparse_state_dict(model, dst, sd)
    assert list(dst.state[model["w"]]) == ["\ud800", "ok"]
    del sd["state.w.\ud800"]
    with pytest.raises(sc.CheckpointMismatchError, match=r"has no saved state '\\ud800'"):
        sc.load_sparse_state_dict(model, torch.optim.SGD(model.parameters(), lr=0.1), sd)


def test_a_parameter_of_another_rank_is_not_checked() -> None:
    """Only the target's parameters must be complete: a shard of the model loads its own."""
    from sparse_ckpt._load.load import load_owned

    model, opt = _source(only_experts=(0, 3))
    sd = sc.sparse_state_dict(model, opt)
    del sd["state.experts.3.up.weight.exp_avg_sq"]  # expert 3 is another rank's here
    shard = make_moe(1)
    shard.load_state_dict(model.state_dict())
    del shard.experts[3]
    dst = sc.MultiOptimizer(
        shard,
        {
            "experts": torch.optim.AdamW(shard.expert_params(), lr=0.5),
            "dense": torch.optim.SGD(shard.dense_params(), lr=0.5, momentum=0.5),
        },
    )
    load_owned(shard, dst, sd, strict=True, unowned_are_other_ranks=True)
    assert_optimizer_equal(dst["dense"], opt["dense"], grads=False)


def test_checkpoints_without_the_record_are_not_checked() -> None:
    """Scalar tables written before the record (legacy) carry no key list: nothing to check."""
    model, opt = _source()
    sd = legacy(sc.sparse_state_dict(model, opt))
    del sd["state.experts.2.up.weight.exp_avg_sq"]
    model2, opt2 = _target(model)
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert "exp_avg_sq" not in opt2["experts"].state[model2.experts[2].up.weight]


# --------------------------------------------------------------------------- DCP


def _dcp_load(path: Path, strict: bool) -> Any:
    def load(model: nn.Module, opt: sc.MultiOptimizer) -> None:
        state = sc.SparseOptimizerState(model, opt, strict=strict)
        dcp.load({"optim": state}, checkpoint_id=path, planner=sc.SparseLoadPlanner())

    return load


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize(
    ("layout", "item"), [("per_tensor", "exp_avg_sq"), ("buffers", "buffer"), ("buffers", "layout")]
)
def test_an_item_removed_from_the_metadata_is_refused(tmp_path: Path, layout: str, item: str, strict: bool) -> None:
    model, opt = _source()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path)
    keys = list(dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata)
    if item == "exp_avg_sq":
        key, match = (
            "optim.state.experts.2.up.weight.exp_avg_sq",
            r"leaf 'experts': parameter 'experts\.2\.up\.weight' has no saved state 'exp_avg_sq'",
        )
    elif item == "buffer":
        key = next(k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}experts.B"))
        match = (
            rf"leaf 'experts': buffer item '{key.removeprefix('optim.')}', "
            r"which holds state 'exp_avg' of 'experts\.0\.up\.weight'"
        )
    else:
        key = next(k for k in keys if k.startswith(f"optim.{BUFFERS_PREFIX}experts.L"))
        match = r"leaf 'experts': parameter 'experts\.0\.up\.weight' has no saved state 'exp_avg'"
    drop_from_metadata(tmp_path, key)
    _refused(model, _dcp_load(tmp_path, strict), match)


@pytest.mark.parametrize("layout", ["per_tensor", "auto"])
@pytest.mark.parametrize("damage", ["lost", "overlapping"])
def test_an_item_whose_chunk_records_are_damaged_is_refused(tmp_path: Path, layout: str, damage: str) -> None:
    """An item still in the ``.metadata`` but with chunk records lost (or listed twice): DCP would
    read nothing (or a part) into the tensor it allocated, and load uninitialized memory as state."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    model, opt = _source()
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)
    key = "optim.state.experts.0.up.weight.exp_avg"
    if layout == "auto":  # a small tensor is buffered: damage the one state item left, the layout table's
        key = next(
            k for k, v in md.state_dict_metadata.items() if k.startswith(f"optim.{BUFFERS_PREFIX}") and ".B" in k
        )
    chunks = md.state_dict_metadata[key].chunks
    if damage == "lost":
        chunks.clear()
    else:
        chunks.append(chunks[0])
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    model2, opt2 = _target(model)
    before = snapshot_optimizer(opt2)
    with pytest.raises((sc.CheckpointFormatError, CheckpointException), match=r"\.metadata lists data for \d+ of its"):
        dcp.load(
            {"optim": sc.SparseOptimizerState(model2, opt2)}, checkpoint_id=tmp_path, planner=sc.SparseLoadPlanner()
        )
    assert_optimizer_equal(opt2, before)


@pytest.mark.parametrize("layout", ["per_tensor", "buffers", "auto"])
def test_any_single_lost_item_is_refused_or_loads_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Complete or refused, exhaustively: for a small checkpoint of each layout (``auto`` with a
    threshold that leaves both per-item and buffered state), removing any single optimizer item from
    the ``.metadata`` either fails the load with the optimizer untouched or loads exactly what was
    saved (only the foreign-loader guards, which hold no state, may go). By default a `_sampling.sample`
    of the items (every kind); CI removes each one."""
    import shutil

    from torch.distributed.checkpoint.api import CheckpointException

    import sparse_ckpt._layouts as layouts

    model, opt = _source()
    sizes = sorted(
        {
            v.numel() * v.element_size()
            for _leaf, o in opt.leaves()
            for st in o.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    )
    monkeypatch.setattr(layouts, "AUTO_OWN_ITEM_BYTES", sizes[len(sizes) // 2])
    saved = tmp_path / "saved"
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout=layout)}, checkpoint_id=saved)
    entries = dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    keys = sample([k for k in entries if k.startswith("optim.")], layout, item_kind)
    guards = {
        k for k in keys if k == f"optim.{PLANNER_GUARD_KEY}" or is_foreign_guard(k.removeprefix("optim."), entries[k])
    }
    outcomes: dict[str, str] = {}
    for key in keys:
        damaged = tmp_path / "damaged"
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(saved, damaged)
        drop_from_metadata(damaged, key)
        model2, opt2 = _target(model)
        with torch.no_grad():  # the source's parameters, the target's own state: an exact load equals the source
            for p2, p in zip(model2.parameters(), model.parameters(), strict=True):
                p2.copy_(p)
        before = {leaf: snapshot_optimizer(o) for leaf, o in opt2.leaves()}
        try:
            dcp.load(
                {"optim": sc.SparseOptimizerState(model2, opt2)}, checkpoint_id=damaged, planner=sc.SparseLoadPlanner()
            )
        except (sc.SparseCheckpointError, CheckpointException):
            for leaf, o in opt2.leaves():
                assert_optimizer_equal(o, before[leaf])
            outcomes[key] = "refused"
        else:
            for leaf, o in opt2.leaves():
                assert_optimizer_equal(o, dict(opt.leaves())[leaf], grads=False)
            outcomes[key] = "exact"
    exact = {k for k, v in outcomes.items() if v == "exact"}
    assert exact == guards, outcomes  # every item that holds state or settings is missed by name
