"""Param-group values real trainers put in their groups round-trip bit-exactly, both formats, in
memory and through DCP: ``torch.dtype`` (VeOmni's ``anyprecision_adamw`` puts
``momentum_dtype`` and friends there), ``torch.device``, enums kept as strings, nested tuples and
lists, ``None``. Anything else is refused at save, before DCP writes a byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import make_moe, same_bits, train

import sparse_ckpt as sc
from sparse_ckpt.errors import CheckpointFormatError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TRAINER_VALUES: dict[str, Any] = {
    "momentum_dtype": torch.bfloat16,
    "variance_dtype": torch.float32,
    "compensation_buffer_dtype": torch.float8_e4m3fn,
    "use_kahan_summation": False,
    "device": torch.device("cpu"),
    "offload_to": torch.device("cuda", 1),
    "mode": "adamw",  # an enum saved as its value
    "schedule": ((0, 1e-3), [None, (torch.float16, torch.device("meta"))]),
    "extra": None,
}


def _optimizer(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_moe(seed)
    groups = [
        {"params": model.dense_params(), **TRAINER_VALUES},
        {"params": model.expert_params(), **TRAINER_VALUES, "momentum_dtype": torch.float16, "mode": "sgd"},
    ]
    return model, torch.optim.AdamW(groups, lr=lr)


def _settings(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _loaded_like(opt: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    assert same_bits(_settings(target), _settings(opt)), (_settings(target), _settings(opt))


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_trainer_group_values_round_trip_in_memory(fmt: str) -> None:
    model, opt = _optimizer(0, 0.01)
    train(model, opt, 2, only_experts=[0])
    sd = sc.sparse_state_dict(model, opt, format=fmt)
    model2, opt2 = _optimizer(0, 0.5)
    for g in opt2.param_groups:
        g.update({k: "changed" for k in TRAINER_VALUES})
    sc.load_sparse_state_dict(model2, opt2, sd)
    _loaded_like(opt, opt2)


@pytest.mark.parametrize("layout", ["per_tensor", "buffers"])
@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_trainer_group_values_round_trip_through_dcp(tmp_path: Path, fmt: str, layout: str) -> None:
    if fmt == "flat" and layout == "buffers":
        pytest.skip("state_layout='buffers' is packed only")
    model, opt = _optimizer(1, 0.01)
    train(model, opt, 2, only_experts=[1])
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=fmt, state_layout=layout)}, checkpoint_id=tmp_path)
    model2, opt2 = _optimizer(1, 0.5)
    for g in opt2.param_groups:
        g.update({k: "changed" for k in TRAINER_VALUES})
    dcp.load(
        {"optim": sc.SparseOptimizerState(model2, opt2, format=fmt)},
        checkpoint_id=tmp_path,
        planner=sc.SparseLoadPlanner(),
    )
    _loaded_like(opt, opt2)


@pytest.mark.parametrize("to", ["packed", "flat"])
def test_trainer_group_values_survive_convert(tmp_path: Path, to: str) -> None:
    """``convert`` re-seals the group tables without their item record: a table holding named
    values (version 2: dtypes, devices) is decoded with them, not refused as unknown tags."""
    from sparse_ckpt.tools.convert import convert_checkpoint

    model, opt = _optimizer(3, 0.01)
    train(model, opt, 2, only_experts=[0])
    dcp.save({"optim": sc.SparseOptimizerState(model, opt)}, checkpoint_id=tmp_path / "src")
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "dst"), to)
    model2, opt2 = _optimizer(3, 0.5)
    for g in opt2.param_groups:
        g.update({k: "changed" for k in TRAINER_VALUES})
    dcp.load(
        {"optim": sc.SparseOptimizerState(model2, opt2, format=to)},
        checkpoint_id=tmp_path / "dst",
        planner=sc.SparseLoadPlanner(),
    )
    _loaded_like(opt, opt2)


class _Schedule:
    """A value no checkpoint format here holds (an arbitrary object)."""


@pytest.mark.parametrize("where", ["top", "nested"])
@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_unsupported_group_value_is_refused_before_dcp_writes(tmp_path: Path, fmt: str, where: str) -> None:
    model, opt = _optimizer(2, 0.01)
    opt.param_groups[1]["schedule"] = _Schedule() if where == "top" else (1, [_Schedule()])
    path = tmp_path / "ckpt"
    with pytest.raises(
        CheckpointFormatError, match=r"leaf 'optim' group 1 key 'schedule': unsupported value type _Schedule"
    ):
        sc.sparse_state_dict(model, opt, format=fmt)
    with pytest.raises(CheckpointFormatError, match="unsupported value type _Schedule"):
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=fmt)}, checkpoint_id=path)
    assert not path.exists() or not any(path.iterdir())
