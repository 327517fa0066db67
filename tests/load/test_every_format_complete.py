"""Complete or refused in every format: the packed format, the flat format (DSD's flat layout, through
`sparse_ckpt.SparseOptimizerState` and a `sparse_ckpt.MultiOptimizer`) and DSD's nested layout (through
``integrations.dsd``'s get/set functions), each of one optimizer and of two, for 13 torch optimizers
(SGD with momentum, Adam, AdamW, NAdam, RAdam, Adamax, Adagrad, Adadelta, RMSprop, Rprop, ASGD, LBFGS,
Adafactor), with a never-stepped parameter and a scheduler-moved lr: a checkpoint that lost any single
item either fails the load with a sparse_ckpt error, the target exactly as it was, or loads exactly
what was saved. The flat and nested formats rely on their key record (docs/formats.md, *Key record*);
a dict without one (stock DSD's) still loads. Fixtures: tests/load/lost_item_sweep.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from _sampling import sample
from lost_item_sweep import (
    FORMATS,
    OPTIMIZERS,
    in_memory_outcomes,
    item_kind,
    make_model,
    optimizers,
    outcomes,
    train,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions

import sparse_ckpt as sc
from sparse_ckpt._format.keys_record import is_record_key
from sparse_ckpt.integrations import dsd
from sparse_ckpt.integrations.dsd.functions import torch_dsd

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_single_lost_item_of_any_optimizer_is_refused_or_exact(fmt: str) -> None:
    """Every optimizer, every item the format writes (as DCP stores them: a list of tensors item by
    item; by default a `_sampling.sample` of them, every kind) removed from the dict alone: refused
    (target untouched) or exact; the state and setting items of every stepped parameter are refused."""
    counts: Counter[str] = Counter()
    for name in OPTIMIZERS:
        result = in_memory_outcomes(name, fmt, pick=lambda items, n=name: sample(items, f"{n}-{fmt}", item_kind))
        bad = {p: v for p, v in result.items() if v not in ("refused", "exact")}
        assert not bad, (name, bad)
        exact = [p for p, v in result.items() if v == "exact"]
        # only what holds no state or setting may go: the key record itself (then nothing is checked,
        # and nothing else is lost)
        assert all(len(p) == 1 and is_record_key(p[0]) for p in exact), (name, exact)
        counts.update(result.values())
    assert counts["refused"] >= 4 * len(OPTIMIZERS)


_DCP_CASES = [
    ("packed", "RMSprop"),
    ("flat", "AdamW"),
    ("flat-multi", "SGD-momentum"),
    ("dsd-flat", "LBFGS"),
    ("dsd-nested", "Adafactor"),
    ("dsd-nested-multi", "ASGD"),
]


@pytest.mark.parametrize(("fmt", "name"), _DCP_CASES, ids=[f"{f}-{n}" for f, n in _DCP_CASES])
def test_any_item_removed_from_the_metadata_is_refused_or_exact(fmt: str, name: str, tmp_path: Path) -> None:
    """Through DCP (each optimizer item, by default a `_sampling.sample` of every kind, removed from
    ``.metadata`` alone, loaded with the library's planner): refused with a sparse_ckpt error and the
    target untouched, or exact (the planner guard and the key record)."""
    result = outcomes(name, fmt, tmp_path, pick=lambda keys: sample(keys, f"{name}-{fmt}", item_kind))
    bad = {k: v for k, v in result.items() if v not in ("refused", "exact")}
    assert not bad, bad
    exact = {k for k, v in result.items() if v == "exact"}
    assert all(".__sparse_ckpt__." in k or k.endswith(".lr") for k in exact), exact  # guards and the record
    assert len(result) - len(exact) >= 4


@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "nested"])
def test_a_lost_setting_or_state_item_is_refused_naming_leaf_fqn_and_key(flatten: bool) -> None:
    """Single-item losses that once loaded silently: SGD's momentum buffer (the parameter's only state),
    a group's lr."""
    model = make_model(0)
    opts = optimizers(model, "SGD-momentum", "flat")
    train(model, opts, 2, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    sd = dict(dsd.get_optimizer_state_dict(model, opts, options=options))
    if flatten:
        lost_state = {k: v for k, v in sd.items() if k != "state.b.weight.momentum_buffer"}
        lost_lr = {k: v for k, v in sd.items() if k != "param_groups.b.weight.lr"}
    else:
        lost_state = {**sd, "state": {k: v for k, v in sd["state"].items() if k != "b.weight"}}
        lost_lr = {
            **sd,
            "param_groups": [sd["param_groups"][0], {k: v for k, v in sd["param_groups"][1].items() if k != "lr"}],
        }
    for damaged, what in ((lost_state, r"state 'momentum_buffer'"), (lost_lr, r"setting 'lr'")):
        target = optimizers(model, "SGD-momentum", "flat")
        with pytest.raises(
            sc.CheckpointMismatchError, match=rf"leaf 'optim': parameter 'b\.weight' has no saved {what}.*key record"
        ):
            dsd.set_optimizer_state_dict(
                model, target, damaged, options=StateDictOptions(flatten_optimizer_state_dict=flatten, strict=False)
            )
        assert not target[0].state


@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "nested"])
def test_stock_dsd_loads_a_dict_with_the_record_and_a_dict_without_it_still_loads(flatten: bool) -> None:
    """torch's own ``set_optimizer_state_dict`` reads a dict holding the key record (it reads only the
    keys it knows), and the library still loads a dict without one (stock DSD's) exactly."""
    model = make_model(0)
    for p in model.parameters():  # stock DSD needs state for every parameter that requires grad
        p.requires_grad_(p is not model["idle"].weight)
    opts = optimizers(model, "AdamW", "flat")
    train(model, opts, 2, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    sd = dict(dsd.get_optimizer_state_dict(model, opts, options=options))
    record = [k for k in sd if is_record_key(k)]
    assert len(record) == 1
    theirs = optimizers(model, "AdamW", "flat")
    torch.optim.lr_scheduler.StepLR(theirs[0], 1)  # DSD's flat loader reads only the target's setting keys (initial_lr)
    torch_dsd["set_optimizer_state_dict"](model, theirs, sd, options=options)
    assert _same(theirs[0], opts[0])
    ours = optimizers(model, "AdamW", "flat")
    dsd.set_optimizer_state_dict(model, ours, {k: v for k, v in sd.items() if k != record[0]}, options=options)
    assert _same(ours[0], opts[0])


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    from helpers import deep_equal

    return deep_equal(a.state_dict(), b.state_dict())


@pytest.mark.parametrize("flatten", [True, False], ids=["flat", "nested"])
def test_a_stock_dcp_load_of_a_checkpoint_with_the_record_loads(flatten: bool, tmp_path: Path) -> None:
    """A checkpoint ``integrations.dsd`` wrote (record included) resumes with stock DSD and a stock
    ``dcp.load``: its target, from torch's ``get_optimizer_state_dict``, lacks the record, so DCP
    does not read it."""
    import torch.distributed.checkpoint as dcp

    model = make_model(0)
    model["idle"].weight.requires_grad_(False)
    opts = optimizers(model, "AdamW", "flat")
    train(model, opts, 2, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    dcp.save({"optim": dsd.get_optimizer_state_dict(model, opts, options=options)}, checkpoint_id=tmp_path)
    theirs = optimizers(model, "AdamW", "flat")
    torch.optim.lr_scheduler.StepLR(theirs[0], 1)
    target = torch_dsd["get_optimizer_state_dict"](model, theirs, options=options)
    assert not any(is_record_key(k) for k in target)
    dcp.load({"optim": target}, checkpoint_id=tmp_path)
    torch_dsd["set_optimizer_state_dict"](model, theirs, target, options=options)
    assert _same(theirs[0], opts[0])
