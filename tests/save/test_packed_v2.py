"""Packed format version 2: each leaf's leading scalar state (``step``, ...) in one scalar table.

* item count: a packed ``dcp.save`` of an Adam MoE writes no per-parameter ``step`` item;
* exact round trips (plain dicts and DCP) equal to torch's own ``load_state_dict`` round trip:
  values bit for bit, dtypes, key order, fused/capturable ``step`` placement; over a sweep of
  torch optimizers, and one more step after the load is bit-identical;
* version 1 (every state value per item) stays readable and restores exactly like version 2;
* several tables of one leaf merge; conflicts, duplicates and corrupt tables are refused;
* FQN aliases, strict/non-strict and other ranks' FQNs behave as for per-item state;
* inspect/verify/diff/convert/export handle scalar tables.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _sampling import params
from helpers import TiedNet, assert_deep_equal, assert_optimizer_equal, make_batch, make_moe, snapshot_optimizer, train
from scalar_tables import as_v1, scalar_table_keys, write_packed_v1
from torch import nn
from torch.distributed.checkpoint import CheckpointException

import sparse_ckpt as sc
from sparse_ckpt import _backend
from sparse_ckpt._format.keys import KEYS_ENTRY, LENS_ENTRY, SCALARS_PREFIX, check_table, scalar_table_key
from sparse_ckpt._format.tensor_parts import parts_to_tensor, tensor_to_parts
from sparse_ckpt._load.load import load_owned
from sparse_ckpt.errors import CheckpointFormatError, CheckpointMismatchError
from sparse_ckpt.tools import convert_checkpoint, diff_checkpoints, inspect_checkpoint, verify_checkpoint
from sparse_ckpt.tools._reader import open_checkpoint, read_entries

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def v1(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool], None]]:
    """``v1(True)``: packed saves write version 1 (per-item scalars) until ``v1(False)``."""

    def set_v1(on: bool) -> None:
        write_packed_v1(monkeypatch, on)

    yield set_v1


# --------------------------------------------------------------------------- helpers


def adam_moe(seed: int = 0, n_experts: int = 4, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_moe(seed, n_experts=n_experts)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **kw)
    return model, opt


def torch_round_trip(model: nn.Module, src: torch.optim.Optimizer, make: Callable[[nn.Module], Any]) -> Any:
    """What torch's own ``load_state_dict`` gives: the reference every load is compared to."""
    ref = make(model)
    ref.load_state_dict(copy.deepcopy(src.state_dict()))
    return ref


def dcp_save(path: Path, model: nn.Module, opt: Any, fmt: str = "packed") -> None:
    # Per-item state tensors, as packed version 1 wrote them: this file compares how the versions
    # store scalars (tables vs items); the state layout is another matter (tests/dcp/test_auto_layout.py).
    state = sc.SparseOptimizerState(model, opt, format=fmt, state_layout="per_tensor")
    dcp.save({"optim": state}, checkpoint_id=str(path), no_dist=True)


def dcp_load(path: Path, model: nn.Module, opt: Any, **kw: Any) -> None:
    dcp.load(
        {"optim": sc.SparseOptimizerState(model, opt, **kw)},
        checkpoint_id=str(path),
        planner=sc.SparseLoadPlanner(),
        no_dist=True,
    )


def item_keys(path: Path) -> list[str]:
    return list(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def scalar_tables_of(sd: dict[str, Any]) -> dict[str, bytes]:
    return {k: sd[k] for k in scalar_table_keys(sd)}


def rebuild_table(leaf: str, groups: list[tuple[dict, list[str]]]) -> tuple[str, bytes]:
    table = _backend.core.encode_table(leaf, groups, torch.Tensor, tensor_to_parts)
    return scalar_table_key(leaf, table), table


def decode_groups(key: str, value: bytes, keys: bool = False) -> tuple[str, list[tuple[dict, list[str]]]]:
    """A scalar table's ``(leaf, [(scalars, fqns), ...])``; the scalars without the recorded
    state keys (:data:`~sparse_ckpt._format.keys.KEYS_ENTRY`) and list lengths (``LENS_ENTRY``) unless ``keys``."""
    leaf, table = check_table(SCALARS_PREFIX, key[len(SCALARS_PREFIX) :], value)
    settings, _blobs, groups = _backend.core.decode_table(leaf, table, parts_to_tensor)
    out = [(dict(settings[i]), list(f)) for i, f in groups]
    if not keys:
        for scalars, _fqns in out:
            scalars.pop(KEYS_ENTRY, None)
            scalars.pop(LENS_ENTRY, None)
    return leaf, out


# --------------------------------------------------------------------------- item count


def test_item_count_of_an_adam_moe(tmp_path: Path, v1: Callable[[bool], None]) -> None:
    """No DCP item per parameter for ``step``: items <= param-shaped tensors + leaves + tables."""
    model = make_moe(0, n_experts=8)
    opt = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.Adam(model.expert_params(), lr=1e-2),
            "dense": torch.optim.AdamW(model.dense_params(), lr=1e-2),
        },
    )
    train(model, opt, 2, only_experts=[0, 2, 5])
    dcp_save(tmp_path / "v2", model, opt)
    keys = [
        k
        for k in item_keys(tmp_path / "v2")
        if k.startswith("optim.") and "load_with" not in k and not k.endswith(".lr")
    ]
    stateful = [p for _leaf, o in opt.leaves() for p in o.state]
    param_shaped = sum(
        1
        for _l, o in opt.leaves()
        for p, s in o.state.items()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.shape == p.shape
    )
    tables = [k for k in keys if "__packed__" in k]
    assert len(tables) == 4  # a group table and a scalar table per leaf
    assert len(keys) <= param_shaped + 2 + len(tables)
    assert len(keys) == param_shaped + len(tables)
    assert not [k for k in keys if k.endswith(".step")]

    v1(True)
    dcp_save(tmp_path / "v1", model, opt)
    old = [
        k
        for k in item_keys(tmp_path / "v1")
        if k.startswith("optim.") and "load_with" not in k and not k.endswith(".lr")
    ]
    assert len(old) == len(keys) + len(stateful) - 2  # one step item per stateful parameter, no scalar tables
    assert sum(k.endswith(".step") for k in old) == len(stateful)


def test_one_group_for_a_shared_step() -> None:
    """Every parameter with the same step: one scalar group listing them all (a tiny table)."""
    model, opt = adam_moe(n_experts=6)
    train(model, opt, 3, only_experts=[1, 4])
    sd = sc.sparse_state_dict(model, opt)
    [(key, table)] = scalar_tables_of(sd).items()
    leaf, groups = decode_groups(key, table, keys=True)
    assert leaf == "optim" and len(groups) == 1
    scalars, fqns = groups[0]
    assert list(scalars) == ["step", KEYS_ENTRY] and float(scalars["step"]) == 3.0
    assert scalars["step"].dtype == torch.float32 and scalars[KEYS_ENTRY] == ("exp_avg", "exp_avg_sq")
    names = {id(p): n for n, p in model.named_parameters()}
    assert fqns == [names[id(p)] for p in opt.state]  # state order
    # header, one step, the recorded keys, the FQNs, the 8-byte seal
    assert len(table) <= 130 + sum(len(f.encode()) + 4 for f in fqns)


# --------------------------------------------------------------------------- exact round trips


def _sweep() -> list[tuple[str, Callable[[Any], torch.optim.Optimizer], list[str]]]:
    """``(name, build(params), expected hoisted keys)``: each torch optimizer's leading scalars."""
    return [
        ("SGD-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), []),
        ("Adam-amsgrad", lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True), ["step"]),
        ("AdamW", lambda ps: torch.optim.AdamW(ps, lr=0.01), ["step"]),
        ("Adam-fused", lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True), ["step"]),
        ("Adam-capturable", lambda ps: torch.optim.Adam(ps, lr=0.01), ["step"]),  # capturable set after training
        ("Adagrad", lambda ps: torch.optim.Adagrad(ps, lr=0.1), ["step"]),
        ("RMSprop", lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True), ["step"]),
        ("Adamax", lambda ps: torch.optim.Adamax(ps, lr=0.01), ["step"]),
        ("NAdam", lambda ps: torch.optim.NAdam(ps, lr=0.01), ["step", "mu_product"]),
        ("RAdam", lambda ps: torch.optim.RAdam(ps, lr=0.01), ["step"]),
        ("Adadelta", lambda ps: torch.optim.Adadelta(ps), ["step"]),
        ("ASGD", lambda ps: torch.optim.ASGD(ps, lr=0.01), ["step", "eta", "mu"]),
        ("Rprop", lambda ps: torch.optim.Rprop(ps, lr=0.01), ["step"]),
        ("LBFGS", lambda ps: torch.optim.LBFGS(ps, lr=0.1, history_size=3, max_iter=2), ["func_evals", "n_iter"]),
    ]


SWEEP = {name: (build, hoisted) for name, build, hoisted in _sweep()}
ROUTES = [(via, name) for i, name in enumerate(SWEEP) for via in (("dict", "dcp"), ("dcp", "dict"))[i % 2]]
"""Every optimizer by both routes; by default (`_sampling.params`) each optimizer by one route, the
routes alternating, and a seeded share of the rest."""


def _trained(name: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    build, _hoisted = SWEEP[name]
    model = make_moe(seed, n_experts=3)
    opt = build(list(model.parameters()))
    _steps(model, opt, 2, seed=seed, only=[0, 2])
    if name == "Adam-capturable":  # capturable cannot step on CPU; its load policy applies all the same
        for group in opt.param_groups:
            group["capturable"] = True
    return model, opt


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, *, seed: int, only: list[int] | None = None) -> None:
    for i in range(n):
        x = make_batch(seed + i, dim=model.embed.in_features)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x, only).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)


@pytest.mark.parametrize(("via", "name"), params(ROUTES, "optimizer-sweep", lambda case: case[1]))
def test_optimizer_sweep_round_trip_equals_torch(name: str, via: str, tmp_path: Path) -> None:
    model, src = _trained(name)
    build, hoisted = SWEEP[name]
    sd = sc.sparse_state_dict(model, src)
    [(key, table)] = scalar_tables_of(sd).items()  # with or without scalars: it records the state keys
    _leaf, groups = decode_groups(key, table)
    assert all(list(s) == hoisted for s, _f in groups), [list(s) for s, _f in groups]
    if hoisted:
        assert not [
            k
            for k in sd
            if k.endswith(tuple(f".{h}" for h in hoisted))
            and k.startswith("state.")
            and not k.startswith(SCALARS_PREFIX)
        ]
    before = snapshot_optimizer(src)

    model2 = make_moe(0, n_experts=3)
    model2.load_state_dict(model.state_dict())
    dst = build(list(model2.parameters()))
    if via == "dict":
        sc.load_sparse_state_dict(model2, dst, sd)
    else:
        dcp_save(tmp_path, model, src)
        dcp_load(tmp_path, model2, dst)
    ref = torch_round_trip(model2, src, lambda m: build(list(m.parameters())))
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)
    assert_deep_equal(snapshot_optimizer(src), before, "source untouched")
    # every parameter has its own scalar tensors (stepped in place)
    tensors = [v for s in dst.state.values() for k, v in s.items() if k in hoisted and isinstance(v, torch.Tensor)]
    assert len({id(t) for t in tensors}) == len(tensors)
    if name == "Adam-capturable":
        assert all(st["step"].dtype == torch.float32 for st in dst.state.values())
        return
    # one more step: bit-identical to the optimizer torch restored
    model_ref = make_moe(0, n_experts=3)
    model_ref.load_state_dict(model.state_dict())
    ref = torch_round_trip(model_ref, src, lambda m: build(list(m.parameters())))
    _steps(model2, dst, 1, seed=50)
    _steps(model_ref, ref, 1, seed=50)
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)
    for p, q in zip(model2.parameters(), model_ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw", [{"fused": True}, {"capturable": True}, {"foreach": False}])
def test_fused_and_capturable_step_placement_like_torch(kw: dict[str, Any]) -> None:
    """Scalar tensors come back on CPU; torch's policy then casts ``step`` only for fused/capturable."""
    model, src = adam_moe(**{k: v for k, v in kw.items() if k != "capturable"})
    train(model, src, 2, only_experts=[0])
    for group in src.param_groups:  # capturable cannot step on CPU: set it after training
        group.update(kw)
    for st in src.state.values():  # a float64 step shows whether it is cast
        st["step"] = st["step"].to(torch.float64)
    sd = sc.sparse_state_dict(model, src)
    model2, dst = adam_moe(seed=3, **kw)
    sc.load_sparse_state_dict(model2, dst, sd)
    ref = torch_round_trip(model2, src, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, **kw))
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)
    want = torch.float32 if kw.get("fused") or kw.get("capturable") else torch.float64
    assert all(s["step"].dtype == want and s["step"].device.type == "cpu" for s in dst.state.values())


def test_v1_and_v2_restore_identically(tmp_path: Path, v1: Callable[[bool], None]) -> None:
    """The same optimizer saved as packed version 1 and 2 restores identically (dicts and DCP)."""
    model, src = adam_moe()
    train(model, src, 2, only_experts=[1, 3])
    sd2 = sc.sparse_state_dict(model, src)
    dcp_save(tmp_path / "v2", model, src)
    v1(True)
    sd1 = sc.sparse_state_dict(model, src)
    dcp_save(tmp_path / "v1", model, src)
    v1(False)
    assert not scalar_table_keys(sd1) and scalar_table_keys(sd2)
    assert_deep_equal(as_v1(sd2), sd1, "v2 expanded is v1")
    # version 1's per-item state is the flat format's (no key here needs an escape): the test
    # helper's version 1 is the real one
    flat = sc.sparse_state_dict(model, src, format="flat")
    assert_deep_equal(
        {k: v for k, v in sd1.items() if k.startswith("state.")},
        {k: v for k, v in flat.items() if k.startswith("state.")},
        "v1 state is DSD's flat state",
    )
    assert any(k.endswith(".step") for k in item_keys(tmp_path / "v1"))
    assert not any(k.endswith(".step") for k in item_keys(tmp_path / "v2"))
    restored = []
    for load in (
        lambda m, o: sc.load_sparse_state_dict(m, o, sd1),
        lambda m, o: sc.load_sparse_state_dict(m, o, sd2),
        lambda m, o: dcp_load(tmp_path / "v1", m, o),
        lambda m, o: dcp_load(tmp_path / "v2", m, o),
    ):
        m2, o2 = adam_moe(seed=5)
        m2.load_state_dict(model.state_dict())
        load(m2, o2)
        restored.append(o2)
    ref = torch_round_trip(m2, src, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    for o in restored:
        assert_optimizer_equal(o, ref, grads=False, state_order=False)


def test_zero_dim_parameter_state_is_all_scalars(v1: Callable[[bool], None]) -> None:
    """A 0-d parameter's Adam state is all 0-d: the whole state is in the table, no per-item entry."""
    model = nn.ParameterDict({"s": nn.Parameter(torch.tensor(1.5)), "v": nn.Parameter(torch.ones(3))})
    src = torch.optim.Adam(model.parameters(), lr=0.1)
    (model["s"] * 2 + model["v"].sum()).backward()
    src.step()
    sd = sc.sparse_state_dict(model, src)
    assert not [k for k in sd if k.startswith("state.s.")]
    assert [k for k in sd if k.startswith("state.v.")] == ["state.v.exp_avg", "state.v.exp_avg_sq"]
    model2 = nn.ParameterDict({"s": nn.Parameter(torch.tensor(1.5)), "v": nn.Parameter(torch.ones(3))})
    dst = torch.optim.Adam(model2.parameters(), lr=0.5)
    sc.load_sparse_state_dict(model2, dst, sd)
    ref = torch_round_trip(model2, src, lambda m: torch.optim.Adam(m.parameters(), lr=0.5))
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)
    assert list(dst.state[model2["s"]]) == ["step", "exp_avg", "exp_avg_sq"]


def test_what_stays_per_item() -> None:
    """Only the leading run of plain str keys with exact bool/int/float/plain 0-d tensors is hoisted."""
    model = nn.ParameterDict({n: nn.Parameter(torch.ones(2)) for n in "abcdefgh"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = dict(model.items())
    big = 2**70
    opt.state[p["a"]] = {"n": 1, "t": torch.zeros(2), "after": 2}  # a scalar after a non-scalar stays
    opt.state[p["b"]] = {"g": torch.tensor(1.0, requires_grad=True)}  # autograd: per item
    opt.state[p["c"]] = {"big": big, "f": 0.5}  # a 65-bit int ends the run
    opt.state[p["d"]] = {"ema.decay": 0.9}  # not a plain part: escaped per item
    opt.state[p["e"]] = {"q": nn.Parameter(torch.tensor(1.0))}  # a Tensor subclass
    opt.state[p["f"]] = {"f8": torch.tensor(1.0).to(torch.float8_e4m3fn)}  # a dtype the codec lacks
    opt.state[p["g"]] = {"b": True, "i": -(2**63), "x": math.nan, "s": torch.tensor(2, dtype=torch.int32), "none": None}
    opt.state[p["h"]] = {"v": torch.arange(3.0)[1]}  # a 0-d view of a larger tensor: hoisted
    sd = sc.sparse_state_dict(model, opt)
    assert sorted(k for k in sd if k.startswith("state.") and not k.startswith(SCALARS_PREFIX)) == sorted(
        [
            "state.a.t",
            "state.a.after",
            "state.b.g",
            "state.c.big",
            "state.c.f",
            "state.d.~sema%2Edecay",
            "state.e.q",
            "state.f.f8",
            "state.g.none",
        ]
    )
    [(key, table)] = scalar_tables_of(sd).items()
    _leaf, groups = decode_groups(key, table, keys=True)
    assert [(list(s), f) for s, f in groups] == [  # every parameter with state, and its per-item keys
        (["n", KEYS_ENTRY], ["a"]),
        ([KEYS_ENTRY], ["b"]),
        ([KEYS_ENTRY], ["c"]),
        ([KEYS_ENTRY], ["d"]),
        ([KEYS_ENTRY], ["e"]),
        ([KEYS_ENTRY], ["f"]),
        (["b", "i", "x", "s", KEYS_ENTRY], ["g"]),
        (["v", KEYS_ENTRY], ["h"]),
    ]
    assert [s[KEYS_ENTRY] for s, _f in groups] == [
        ("t", "after"),
        ("g",),
        ("big", "f"),
        ("~sema%2Edecay",),
        ("q",),
        ("f8",),
        ("none",),
        (),
    ]
    model2 = nn.ParameterDict({n: nn.Parameter(torch.ones(2)) for n in "abcdefgh"})
    dst = torch.optim.SGD(model2.parameters(), lr=0.1)
    sc.load_sparse_state_dict(model2, dst, sd)
    ref = torch_round_trip(model2, opt, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)
    assert dst.state[model2["b"]]["g"].requires_grad  # kept per item: exactly as saved
    assert type(dst.state[model2["e"]]["q"]) is nn.Parameter


def test_saving_mutates_nothing_and_snapshots() -> None:
    model, opt = adam_moe()
    train(model, opt, 1, only_experts=[0])
    before = snapshot_optimizer(opt)
    steps = [s["step"] for s in opt.state.values()]
    sd = sc.sparse_state_dict(model, opt)
    assert_deep_equal(snapshot_optimizer(opt), before)
    assert all(s["step"] is t for s, t in zip(opt.state.values(), steps))
    table = sd[scalar_table_keys(sd)[0]]
    train(model, opt, 1, only_experts=[0])  # steps in place: the saved table is bytes, unaffected
    assert sd[scalar_table_keys(sd)[0]] is table
    model2, opt2 = adam_moe()
    sc.load_sparse_state_dict(model2, opt2, sd)
    assert all(float(s["step"]) == 1.0 for s in opt2.state.values())


@pytest.mark.parametrize("first", [True, False])
def test_reserved_fqn_is_refused(first: bool) -> None:
    model = nn.Module()
    if not first:
        model.add_module("a", nn.Linear(2, 2))
    model.add_module("__packed__", nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for fmt in ("packed", "flat"):
        with pytest.raises(CheckpointFormatError, match="reserved"):
            sc.sparse_state_dict(model, opt, format=fmt)


def test_reserved_marker_inside_an_fqn_is_fine() -> None:
    """Only an FQN that *starts* with ``__packed__.`` is reserved (one with it after a newline in a
    module name is not, though the quick check of the joined FQNs sees it)."""
    model = nn.Module()
    model.add_module("x\n__packed__", nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = sc.sparse_state_dict(model, opt)
    assert "state.x\n__packed__.weight.exp_avg" in sd


# --------------------------------------------------------------------------- merge and refusals


def _two_rank_dicts() -> tuple[nn.Module, dict[str, Any], dict[str, Any], torch.optim.Optimizer]:
    """Two 'ranks' of one leaf, each with state on different experts (different scalar tables)."""
    model, opt = adam_moe(n_experts=4)
    train(model, opt, 2, only_experts=[0, 1])
    sd = sc.sparse_state_dict(model, opt)
    [(key, table)] = scalar_tables_of(sd).items()
    leaf, [(scalars, fqns)] = decode_groups(key, table, keys=True)
    rank0 = [f for f in fqns if ".1." not in f]
    rank1 = [f for f in fqns if ".1." in f or not f.startswith("experts.")]  # dense FQNs on both ranks
    base = {k: v for k, v in sd.items() if k != key}
    a = dict(base)
    b = {}
    for r, dest in ((rank0, a), (rank1, b)):
        k, t = rebuild_table(leaf, [(scalars, r)])
        dest[k] = t
    return model, a, b, opt


def test_tables_of_several_ranks_merge() -> None:
    model, a, b, src = _two_rank_dicts()
    merged = {**a, **b}
    assert len(scalar_table_keys(merged)) == 2
    model2, dst = adam_moe(seed=4)
    model2.load_state_dict(model.state_dict())
    sc.load_sparse_state_dict(model2, dst, merged)
    ref = torch_round_trip(model2, src, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)


def test_conflicting_tables_are_refused() -> None:
    _model, a, b, _src = _two_rank_dicts()
    [(key, table)] = scalar_tables_of(b).items()
    leaf, groups = decode_groups(key, table, keys=True)
    k, t = rebuild_table(leaf, [({**groups[0][0], "step": torch.tensor(9.0)}, groups[0][1])])
    bad = {**a, k: t}
    model2, dst = adam_moe(seed=4)
    before = snapshot_optimizer(dst)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"leaf 'optim': parameter 'embed\.weight' has different "
        r"scalar state in two scalar tables .*key 'step'",
    ):
        sc.load_sparse_state_dict(model2, dst, bad)
    assert_deep_equal(snapshot_optimizer(dst), before, "unchanged after a failed load")


def test_scalar_also_per_item_is_refused() -> None:
    model, opt = adam_moe()
    train(model, opt, 1)
    sd = sc.sparse_state_dict(model, opt)
    sd["state.embed.weight.step"] = torch.tensor(1.0)
    with pytest.raises(
        CheckpointFormatError,
        match=r"leaf 'optim': state key 'step' of 'embed\.weight' is both in a "
        r"scalar table and the per-item entry 'state\.embed\.weight\.step'",
    ):
        sc.load_sparse_state_dict(model, torch.optim.Adam(model.parameters()), sd)


@pytest.mark.parametrize("damage", ["digest", "seal", "not-bytes", "truncated", "no-tag"])
def test_bad_scalar_tables_are_refused(damage: str) -> None:
    model, opt = adam_moe()
    train(model, opt, 1)
    sd = sc.sparse_state_dict(model, opt)
    [(key, table)] = scalar_tables_of(sd).items()
    del sd[key]
    if damage == "digest":  # a legacy digest key that does not match, and a broken seal
        payload = check_table(SCALARS_PREFIX, key[len(SCALARS_PREFIX) :], table)[1]
        bad = scalar_table_key("optim", payload)
        sd[bad[:-1] + ("0" if bad[-1] != "0" else "1")] = payload
        match = "scalar table .* does not match its digest"
    elif damage == "seal":
        sd[key] = table[:-1] + bytes([table[-1] ^ 1])
        match = "scalar table .* does not match its sealed digest"
    elif damage == "not-bytes":
        sd[key] = torch.frombuffer(bytearray(table), dtype=torch.uint8)
        match = "scalar table .* is a Tensor, expected bytes"
    elif damage == "truncated":
        short = check_table(SCALARS_PREFIX, key[len(SCALARS_PREFIX) :], table)[1][:-3]
        sd[scalar_table_key("optim", short)] = short
        match = "scalar table 'state.__packed__.optim.* truncated"
    else:
        sd[SCALARS_PREFIX + "optim"] = table
        match = "scalar table key .* has no leaf/tag"
    with pytest.raises(CheckpointFormatError, match=match):
        sc.load_sparse_state_dict(model, torch.optim.Adam(model.parameters()), sd)


# --------------------------------------------------------------------------- FQN resolution


_Tied = TiedNet


def test_scalar_table_fqn_alias_resolves() -> None:
    """A scalar table naming a tied parameter by its alias loads onto the canonical parameter."""
    model = _Tied()
    src = torch.optim.Adam(model.parameters(), lr=0.01)
    model.enc.weight.grad = torch.ones(3, 3)
    src.step()
    sd = sc.sparse_state_dict(model, src)
    [(key, table)] = scalar_tables_of(sd).items()
    leaf, groups = decode_groups(key, table, keys=True)
    assert groups[0][1] == ["enc.weight"]
    del sd[key]
    k, t = rebuild_table(leaf, [(groups[0][0], ["dec.weight"])])
    sd[k] = t
    renamed = {kk.replace("state.enc.weight", "state.dec.weight"): v for kk, v in sd.items()}
    for variant in (sd, renamed):  # per-item keys by canonical name or by the same alias
        dst = torch.optim.Adam(model.parameters(), lr=0.5)
        sc.load_sparse_state_dict(model, dst, variant)
        assert list(dst.state[model.enc.weight]) == ["step", "exp_avg", "exp_avg_sq"]
        ref = torch_round_trip(model, src, lambda m: torch.optim.Adam(m.parameters(), lr=0.5))
        assert_optimizer_equal(dst, ref, grads=False, state_order=False)


def _pair(names: str) -> nn.Module:
    return nn.ParameterDict({n: nn.Parameter(torch.full((2,), float(i))) for i, n in enumerate(names)})


def _saved(names: str, scalar_tables: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    write_packed_v1(monkeypatch, not scalar_tables)
    model = _pair(names)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return sc.sparse_state_dict(model, opt)


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome itself is compared
        return type(exc), str(exc)
    return ("ok",)


def test_extra_state_strict_and_non_strict_like_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A saved FQN the target lacks is 'extra' exactly as with per-item state (same errors), is
    ignored by non-strict loads, and belongs to another rank under ``unowned_are_other_ranks``."""
    sds = {v: _saved("ab", v, monkeypatch) for v in (False, True)}
    assert scalar_table_keys(sds[True]) and not scalar_table_keys(sds[False])
    outcomes = {}
    for v, sd in sds.items():
        runs = []
        for strict, unowned in ((True, False), (False, False), (True, True)):
            model = _pair("a")
            opt = torch.optim.Adam(model.parameters(), lr=0.5)
            runs.append(
                _outcome(
                    lambda sd=sd, m=model, o=opt, s=strict, u=unowned: load_owned(
                        m, o, sd, strict=s, unowned_are_other_ranks=u
                    )
                )
            )
            if runs[-1] == ("ok",):
                assert list(opt.state[model["a"]]) == ["step", "exp_avg", "exp_avg_sq"]
        outcomes[v] = runs
    assert outcomes[True] == outcomes[False]
    assert outcomes[True][0][0] is CheckpointMismatchError and "'b'" in outcomes[True][0][1]
    assert outcomes[True][1:] == [("ok",), ("ok",)]


def test_scalars_of_an_unknown_fqn_are_unmatched_like_v1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scalars of an FQN no table lists are the same unmatched keys a per-item ``state.x.step`` is."""
    sd2 = _saved("a", True, monkeypatch)
    sd1 = _saved("a", False, monkeypatch)
    [(key, table)] = scalar_tables_of(sd2).items()
    leaf, groups = decode_groups(key, table, keys=True)
    del sd2[key]
    k, t = rebuild_table(leaf, [(groups[0][0], ["a", "ghost"])])
    sd2[k] = t
    sd1["state.ghost.step"] = torch.tensor(1.0)
    outcomes = []
    for sd in (sd1, sd2):
        for strict in (True, False):
            model = _pair("a")
            outcomes.append(
                _outcome(
                    lambda sd=sd, m=model, s=strict: sc.load_sparse_state_dict(
                        m, torch.optim.Adam(m.parameters()), sd, strict=s
                    )
                )
            )
    assert outcomes[:2] == outcomes[2:]
    assert outcomes[0][0] is CheckpointMismatchError and "'state.ghost.step'" in outcomes[0][1]
    assert outcomes[1] == ("ok",)


# --------------------------------------------------------------------------- tools


@pytest.fixture
def both_versions(tmp_path: Path, v1: Callable[[bool], None]) -> tuple[Path, Path, nn.Module, torch.optim.Optimizer]:
    model = make_moe(0, n_experts=4)
    opt = torch.optim.ASGD(model.parameters(), lr=0.01)
    _steps(model, opt, 2, seed=0, only=[0, 3])
    dcp_save(tmp_path / "v2", model, opt)
    v1(True)
    dcp_save(tmp_path / "v1", model, opt)
    v1(False)
    return tmp_path / "v1", tmp_path / "v2", model, opt


def test_inspect_verify_diff_see_the_same_state(both_versions: tuple[Path, Path, nn.Module, Any]) -> None:
    p1, p2, _model, opt = both_versions
    r1, r2 = inspect_checkpoint(str(p1))["optimizers"][0], inspect_checkpoint(str(p2))["optimizers"][0]
    assert r2["scalar_tables"] == 1 and r1["scalar_tables"] == 0
    assert r2["items"] == r1["items"] - len(opt.state) * 3 + 1
    for field in ("items", "table_bytes", "disk_bytes", "scalar_tables"):
        r1.pop(field), r2.pop(field)
    assert r1 == r2  # parameters with state, state keys, dtypes, bytes, experts: all the same
    assert r2["with_state"] == len(opt.state) and r2["leaves"][0]["state_keys"]["step"]["count"] == len(opt.state)
    assert r2["leaves"][0]["state_keys"]["eta"]["dtypes"] == ["float32"]
    for p in (p1, p2):
        report = verify_checkpoint(str(p))
        assert report["ok"], report["problems"]
    assert diff_checkpoints(str(p1), str(p2))["differences"] == 0


def test_verify_reports_a_corrupt_scalar_table(tmp_path: Path) -> None:
    model, opt = adam_moe()
    train(model, opt, 1)
    sd = sc.sparse_state_dict(model, opt)
    [(key, table)] = scalar_tables_of(sd).items()
    sd[key] = table[:-2] + b"\xff\xff"  # the seal no longer matches
    dcp.save({"optim": sd}, checkpoint_id=str(tmp_path), no_dist=True)
    report = verify_checkpoint(str(tmp_path))
    assert not report["ok"] and "does not match its sealed digest" in report["problems"][0]["problem"]


def test_convert_to_flat_expands_and_back(both_versions: tuple[Path, Path, nn.Module, Any], tmp_path: Path) -> None:
    _p1, p2, model, opt = both_versions
    convert_checkpoint(str(p2), str(tmp_path / "flat"), "flat")
    keys = item_keys(tmp_path / "flat")
    assert not [k for k in keys if "__packed__" in k]
    assert sum(k.endswith((".step", ".eta", ".mu")) for k in keys) == 3 * len(opt.state)
    convert_checkpoint(str(tmp_path / "flat"), str(tmp_path / "packed"), "packed")
    md = open_checkpoint(str(p2))
    table_key = next(k for k in md.state_dict_metadata if "state.__packed__" in k)
    assert isinstance(read_entries(str(p2), md, [table_key])[table_key], bytes)
    for src in (p2, tmp_path / "flat", tmp_path / "packed"):
        model2 = make_moe(0, n_experts=4)
        model2.load_state_dict(model.state_dict())
        dst = torch.optim.ASGD(model2.parameters(), lr=0.01)
        dcp_load(src, model2, dst)
        ref = torch_round_trip(model2, opt, lambda m: torch.optim.ASGD(m.parameters(), lr=0.01))
        assert_optimizer_equal(dst, ref, grads=False, state_order=False)


def test_export_round_trips_scalars(both_versions: tuple[Path, Path, nn.Module, Any], tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from sparse_ckpt.tools.export import export_checkpoint, load_export, read_export

    p1, p2, model, opt = both_versions
    s1 = export_checkpoint(str(p1), str(tmp_path / "e1"))
    s2 = export_checkpoint(str(p2), str(tmp_path / "e2"))
    assert (s1.tensors, s1.values, s1.tables) == (s2.tensors, s2.values, s2.tables)
    assert s2.tensors == sum(len(s) for s in opt.state.values())  # scalars exported as per-item entries
    e1, e2 = read_export(str(tmp_path / "e1")), read_export(str(tmp_path / "e2"))
    assert_deep_equal(e1, e2, "exports of v1 and v2", check_order=False)
    assert not scalar_table_keys(e2)
    model2 = make_moe(0, n_experts=4)
    model2.load_state_dict(model.state_dict())
    dst = torch.optim.ASGD(model2.parameters(), lr=0.01)
    load_export(model2, dst, str(tmp_path / "e2"))
    ref = torch_round_trip(model2, opt, lambda m: torch.optim.ASGD(m.parameters(), lr=0.01))
    assert_optimizer_equal(dst, ref, grads=False, state_order=False)


def test_cli_inspect_names_the_scalar_tables(both_versions: tuple[Path, Path, nn.Module, Any]) -> None:
    from sparse_ckpt.tools.inspect import format_inspect, inspect_details

    _p1, p2, _model, opt = both_versions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = format_inspect(*inspect_details(str(p2)))
    assert "(1 scalar table)" in text
    assert f"state step: float32 x{len(opt.state)}" in text


def test_planner_reads_scalar_tables_weights_only_as_bytes(tmp_path: Path) -> None:
    """A scalar table item that is no ``bytes`` is refused while DCP reads it (``weights_only``)."""
    model, opt = adam_moe()
    train(model, opt, 1)
    sd = sc.sparse_state_dict(model, opt)
    [key] = scalar_table_keys(sd)
    dcp.save({"optim": {**sd, key: [1, 2]}}, checkpoint_id=str(tmp_path), no_dist=True)
    model2, opt2 = adam_moe()
    before = snapshot_optimizer(opt2)
    with pytest.raises(CheckpointException, match=r"scalar table 'optim\.state\.__packed__\.optim\.w1r0' holds a list"):
        dcp_load(tmp_path, model2, opt2)
    assert_deep_equal(snapshot_optimizer(opt2), before, "unchanged")
