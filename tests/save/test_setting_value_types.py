"""Group setting values and per-parameter state values round-trip like torch's own
``state_dict()``/``load_state_dict()`` -- the same type and value back -- or are refused at save,
before anything is written, naming leaf, group or FQN, key and type; never saved-then-unloadable,
never a silent type change.

Settings: the table codec writes exact ``int``, ``float``, ``str``, ``bytes``, ``tuple`` and
``list`` values; a value of a subclass of one of them (``numpy.float64``, an ``IntEnum`` or ``str``
``Enum`` member, a ``namedtuple``, a user's subclass) would decode as the base type, so every format
refuses it at save (docs/formats.md, *Table codec*); an ``Enum`` member of no such base was refused
already. State values that are not tensors or scalar-table scalars are DCP bytes items, which a load
reads weights-only: a ``numpy`` scalar, an ``Enum`` member, a ``Decimal``, a ``Fraction`` or a
user's subclass would be refused by the checkpoint's own load, so every format (the in-memory dict
included) refuses it at save (docs/formats.md, *State values*). `integrations.dsd` hands an
optimizer holding any such value to torch's DSD instead (one warning): a call that works with
stock DSD keeps working."""

from __future__ import annotations

import copy
import enum
import warnings
from collections import Counter, OrderedDict, namedtuple
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd_stock
from helpers import assert_deep_equal
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import sparse_ckpt as sc
from sparse_ckpt.integrations import dsd

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Mode(enum.IntEnum):
    FAST = 1


class Kind(str, enum.Enum):
    ADAM = "adam"


class Color(enum.Enum):
    RED = 1


class MyFloat(float):
    pass


class MyInt(int):
    pass


class MyStr(str):
    pass


class MyTuple(tuple):
    pass


Betas = namedtuple("Betas", ["beta1", "beta2"])

VALUES: dict[str, tuple[str, Any, str]] = {  # case -> (setting key, value, type name in the message)
    "numpy.float64": ("lr", np.float64(0.01), "numpy.float64"),
    "IntEnum": ("mode", Mode.FAST, "Mode"),
    "str-Enum": ("kind", Kind.ADAM, "Kind"),
    "Enum": ("color", Color.RED, "Color"),
    "namedtuple": ("betas", Betas(0.9, 0.999), "Betas"),
    "float-subclass": ("lr", MyFloat(0.01), "MyFloat"),
    "int-subclass": ("period", MyInt(3), "MyInt"),
    "str-subclass": ("tag", MyStr("x"), "MyStr"),
    "tuple-subclass": ("betas", MyTuple((0.9, 0.999)), "MyTuple"),
    "nested in a tuple": ("betas", (0.9, np.float64(0.999)), "numpy.float64"),
}
SAVES = ("sparse_state_dict-packed", "sparse_state_dict-flat", "dcp-packed", "dcp-flat")
"""The library's own formats; `integrations.dsd` hands such values to torch's DSD instead (below)."""


def _save(how: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    if how.startswith("sparse_state_dict-"):
        sc.sparse_state_dict(model, opt, format=how.split("-")[1])  # type: ignore[arg-type]
    elif how.startswith("dcp-"):
        dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=how.split("-")[1])}, checkpoint_id=path)  # type: ignore[arg-type]
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", SAVES)
@pytest.mark.parametrize("case", list(VALUES))
def test_a_subclass_value_is_refused_at_save_before_anything_is_written(case: str, how: str, tmp_path: Path) -> None:
    key, value, type_name = VALUES[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.param_groups[0][key] = value
    before = copy.deepcopy(opt.state_dict())  # (the test helpers' snapshot cannot clone a namedtuple)
    path = tmp_path / "ckpt"
    with pytest.raises(sc.CheckpointFormatError, match=rf"leaf 'optim' group 0 key '{key}'.*{type_name}"):
        _save(how, model, opt, path)
    assert not path.exists() or not any(path.iterdir())  # nothing written
    assert_deep_equal(opt.state_dict(), before)
    assert type(opt.param_groups[0][key]) is type(value)


@pytest.mark.parametrize("fmt", ["packed", "flat"])
def test_plain_values_come_back_with_their_type(fmt: str, tmp_path: Path) -> None:
    """The control: the exact types the codec writes load back as themselves, through DCP."""
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    opt.param_groups[0].update(period=3, tag="x", blob=b"\x00", sizes=[1, 2], flag=True, none=None)
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, format=fmt)}, checkpoint_id=tmp_path)  # type: ignore[arg-type]
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5)
    dcp.load(
        {"optim": sc.SparseOptimizerState(model, opt2, format=fmt)},
        checkpoint_id=tmp_path,  # type: ignore[arg-type]
        planner=sc.SparseLoadPlanner(),
    )
    for k, v in opt.param_groups[0].items():
        if k != "params":
            assert type(opt2.param_groups[0][k]) is type(v) and opt2.param_groups[0][k] == v, k


DSD_SETTINGS: dict[str, tuple[str, Any]] = {  # case -> (setting key, value): more the table codec cannot hold
    "int beyond 64 bits": ("period", 2**70),
    "negative int beyond 64 bits": ("period", -(2**64) - 1),
    "str with a lone surrogate": ("tag", "x\ud800"),
    "dict": ("extra", {"a": 1}),
    "set": ("extra", {1, 2}),
    "Decimal": ("lr", Decimal("0.01")),
    "Fraction": ("lr", Fraction(1, 100)),
    "object": ("extra", Color),
}


def _dsd_setting_round_trip(key: str, value: Any, options: StateDictOptions, path: Path, installed: bool) -> Any:
    """A trainer's save and resume through DSD's functions (``installed``: under `dsd.install()`, each get
    and set warning once that it goes to torch's DSD) of an optimizer whose group setting ``key`` is
    ``value``: the value the resumed optimizer holds."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.param_groups[0][key] = value
    warn = _one_warning if installed else (lambda call: call())
    if installed:
        dsd.install()  # as a trainer runs it: its dcp.load plans the marked target from the checkpoint
    try:
        dcp.save(
            {"optim": warn(lambda: dsd_stock.get_optimizer_state_dict(model, opt, options=options))}, checkpoint_id=path
        )
        model2, opt2 = build()
        # a key AdamW does not have is set by the trainer's own code, again on resume (DSD's flat
        # layout loads only the keys the target's groups have, stock as here)
        opt2.param_groups[0][key] = value
        target = {"optim": warn(lambda: dsd_stock.get_optimizer_state_dict(model2, opt2, options=options))}
        dcp.load(target, checkpoint_id=path)
        warn(lambda: dsd_stock.set_optimizer_state_dict(model2, opt2, target["optim"], options=options))
    finally:
        if installed:
            dsd.uninstall()
    assert len(opt2.state) == len(opt.state)
    return opt2.param_groups[0][key]


@pytest.mark.parametrize("layout", ["flat", "nested"])
@pytest.mark.parametrize("case", [*VALUES, *DSD_SETTINGS])
def test_the_dsd_drop_in_hands_a_setting_value_to_torch_dsd_as_stock_does(
    case: str, layout: str, tmp_path: Path
) -> None:
    """A call that works with stock DSD keeps working: `integrations.dsd`'s get and set go to torch's
    DSD (one warning each) for an optimizer with a setting sparse_ckpt's formats cannot give back as it
    is (a subclass, an int beyond 64 bits, a str with a lone surrogate, any other type), so the value
    round-trips through DCP as stock gives it back; never a refusal stock does not make."""
    key, value = DSD_SETTINGS[case] if case in DSD_SETTINGS else VALUES[case][:2]
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")
    try:
        stock: Any = _dsd_setting_round_trip(key, value, options, tmp_path / "stock", installed=False)
    except Exception as exc:  # noqa: BLE001 - whatever stock DSD raises
        stock = exc
    try:
        got = _dsd_setting_round_trip(key, value, options, tmp_path / "installed", installed=True)
    except Exception as exc:  # noqa: BLE001 - only what stock DSD raises too
        assert isinstance(stock, Exception) and type(exc) is type(stock), (exc, stock)
        return
    assert not isinstance(stock, Exception), stock
    assert type(got) is type(stock) is type(value) and got == stock == value


# --------------------------------------------------------------------------- state values

STATE_VALUES: dict[str, tuple[Any, str, str, Callable[[Any], Any]]] = {
    # case -> (state value, type name in the message, the advice, the advice followed)
    "numpy.float64": (np.float64(0.25), "numpy.float64", "value.item()", lambda v: v.item()),
    "numpy.int64": (np.int64(3), "numpy.int64", "value.item()", lambda v: v.item()),
    "numpy.float32": (np.float32(0.25), "numpy.float32", "torch.tensor(value)", torch.tensor),
    "numpy.bool": (np.bool_(True), "numpy.bool", "value.item()", lambda v: v.item()),
    "IntEnum": (Mode.FAST, "Mode", "member.value", lambda v: v.value),
    "str-Enum": (Kind.ADAM, "Kind", "member.value", lambda v: v.value),
    "Enum": (Color.RED, "Color", "member.value", lambda v: v.value),
    "float-subclass": (MyFloat(0.25), "MyFloat", "float(value)", float),
    "int-subclass": (MyInt(3), "MyInt", "int(value)", int),
    "namedtuple": (Betas(0.9, 0.999), "Betas", "tuple(value)", tuple),
    "tuple-subclass": (MyTuple((0.9, 0.999)), "MyTuple", "tuple(value)", tuple),
    "Decimal": (Decimal("0.1"), "decimal.Decimal", "str(value)", str),
    "Fraction": (Fraction(1, 3), "fractions.Fraction", "float(value)", float),
    "nested in a tuple": ((0.9, np.float64(0.999)), "numpy.float64", "value.item()", lambda v: (v[0], v[1].item())),
    # a dict state value is flattened into keys: a dict of another type would come back a plain dict
    "OrderedDict": (OrderedDict(a=1), "collections.OrderedDict", "dict(value)", dict),
    "Counter in a dict": ({"c": Counter(a=2)}, "collections.Counter", "dict(value)", lambda v: {"c": dict(v["c"])}),
}
STATE_SAVES = (*SAVES, "dcp-MultiOptimizer")
"""The library's formats and Statefuls (`integrations.dsd` and its nested layout: further below)."""


def _stepped(seed: int = 0, steps: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    return model, opt


def _save_and_load(how: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> torch.optim.Optimizer:
    """Save ``opt`` as ``how`` does and load it into a fresh optimizer over ``model`` (returned)."""
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    fmt = how.split("-")[1]
    if how.startswith("sparse_state_dict-"):
        sc.load_sparse_state_dict(model, fresh, sc.sparse_state_dict(model, opt, format=fmt))  # type: ignore[arg-type]
        return fresh
    if how == "dcp-MultiOptimizer":

        def state(o: torch.optim.Optimizer) -> Any:
            return sc.MultiOptimizer(model, {"optim": o})
    else:

        def state(o: torch.optim.Optimizer) -> Any:
            return sc.SparseOptimizerState(model, o, format=fmt)  # type: ignore[arg-type]

    dcp.save({"optim": state(opt)}, checkpoint_id=path)
    dcp.load({"optim": state(fresh)}, checkpoint_id=path, planner=sc.SparseLoadPlanner())
    return fresh


def _save_state(how: str, model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    if how == "dcp-MultiOptimizer":
        dcp.save({"optim": sc.MultiOptimizer(model, {"optim": opt})}, checkpoint_id=path)
    else:
        _save(how, model, opt, path)


@pytest.mark.parametrize("how", STATE_SAVES)
@pytest.mark.parametrize("case", list(STATE_VALUES))
def test_a_state_value_a_load_cannot_give_back_is_refused_at_save(case: str, how: str, tmp_path: Path) -> None:
    """Saved as a DCP bytes item, such a value would be refused by the checkpoint's own
    (weights-only) load: the save refuses it first, naming leaf, FQN, key, type and what to store."""
    value, type_name, advice, _fix = STATE_VALUES[case]
    model, opt = _stepped()
    opt.state[model[0].weight]["extra"] = value
    before = copy.deepcopy(opt.state_dict())
    path = tmp_path / "ckpt"
    match = rf"leaf 'optim': state 'extra' of '0.weight': .*{type_name}"
    with pytest.raises(sc.CheckpointFormatError, match=match) as err:
        _save_state(how, model, opt, path)
    assert advice in str(err.value)
    assert not path.exists() or not any(path.iterdir())  # nothing written
    assert_deep_equal(opt.state_dict(), before)
    assert type(opt.state[model[0].weight]["extra"]) is type(value)


@pytest.mark.parametrize("how", STATE_SAVES)
@pytest.mark.parametrize("case", list(STATE_VALUES))
def test_the_state_value_refusal_s_advice_followed_saves_and_loads_back(case: str, how: str, tmp_path: Path) -> None:
    value, _type_name, _advice, fix = STATE_VALUES[case]
    model, opt = _stepped()
    fixed = fix(value)
    opt.state[model[0].weight]["extra"] = fixed
    got = _save_and_load(how, model, opt, tmp_path / "ckpt").state[model[0].weight]["extra"]
    assert type(got) is type(fixed)
    assert torch.equal(got, fixed) if isinstance(fixed, torch.Tensor) else got == fixed


PLAIN_STATE = {
    "none": None,
    "flag": True,
    "count": 3,
    "huge": 2**70,
    "rate": 0.25,
    "z": complex(1, 2),
    "tag": "x\ud800",
    "blob": b"\x00",
    "buf": bytearray(b"\x01"),
    "pair": (1, 2.0),
    "seq": [1, "a"],
    "bag": {1, 2},
    "table": {"a": 1},
    "in_pair": ({"a": 1}, OrderedDict(a=1), Counter(a=2)),
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "size": torch.Size([2, 3]),
    "in_list": [torch.ones(2)],
    "empty": [],
}


@pytest.mark.parametrize("how", STATE_SAVES)
def test_plain_state_values_come_back_with_their_type(how: str, tmp_path: Path) -> None:
    """The control: every state value a load gives back as itself is saved, and loads back with its
    type and value (ints beyond 64 bits and strs with a lone surrogate as items of their own)."""
    model, opt = _stepped()
    opt.state[model[0].weight].update(PLAIN_STATE)
    state = _save_and_load(how, model, opt, tmp_path / "ckpt").state[model[0].weight]
    for key, value in PLAIN_STATE.items():
        got = state[key]
        assert type(got) is type(value), key
        assert_deep_equal(got, value, where=key)


def _one_warning(call: Callable[[], Any], at_most: bool = False) -> Any:
    """``call()``, which must warn exactly once (``at_most``: once or not at all) that it goes to torch's DSD."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = call()
    warned = [w for w in seen if "goes to torch's DSD" in str(w.message)]
    assert len(warned) in ((0, 1) if at_most else (1,)), [str(w.message) for w in seen]
    return out


def _dsd_state_round_trip(value: Any, options: StateDictOptions, path: Path, installed: bool) -> Any:
    """A trainer's save and resume through DSD's functions (``installed``: under `dsd.install()`, each
    get warning once that it goes to torch's DSD) of an optimizer whose state holds ``value``: the value
    the resumed optimizer holds."""
    model, opt = _stepped(steps=2)
    opt.state[model[0].weight]["extra"] = value
    warn = _one_warning if installed else (lambda call, at_most=False: call())
    if installed:
        dsd.install()
    try:
        sd = warn(lambda: dsd_stock.get_optimizer_state_dict(model, opt, options=options))
        dcp.save({"optim": sd}, checkpoint_id=path)
        model2, opt2 = _stepped(seed=1)  # the optimizer's own step creates the entry, as in the run saved
        opt2.state[model2[0].weight]["extra"] = value
        target = {"optim": warn(lambda: dsd_stock.get_optimizer_state_dict(model2, opt2, options=options))}
        dcp.load(target, checkpoint_id=path)
        # the loaded dict holds the value as it is: the library's loader sets it (or torch's, one warning)
        warn(lambda: dsd_stock.set_optimizer_state_dict(model2, opt2, target["optim"], options=options), at_most=True)
    finally:
        if installed:
            dsd.uninstall()
    assert_deep_equal(opt2.state[model2[0].weight]["step"], opt.state[model[0].weight]["step"])  # loaded: 2 steps
    return opt2.state[model2[0].weight]["extra"]


@pytest.mark.parametrize("layout", ["flat", "nested"])
@pytest.mark.parametrize("case", list(STATE_VALUES))
def test_the_dsd_drop_in_hands_a_state_value_to_torch_dsd_as_stock_does(case: str, layout: str, tmp_path: Path) -> None:
    """A state value sparse_ckpt's formats cannot give back sends `dsd.install()`'s calls to torch's
    DSD (one warning each), both layouts: never a new refusal. What stock DSD gives back comes back
    as stock gives it; a refusal is only one stock makes too (its flat layout takes tensor, int,
    float and dict state only)."""
    value = STATE_VALUES[case][0]
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")
    try:
        stock: Any = _dsd_state_round_trip(value, options, tmp_path / "stock", installed=False)
    except Exception as exc:  # noqa: BLE001 - whatever stock DSD raises
        stock = exc
    try:
        got = _dsd_state_round_trip(value, options, tmp_path / "installed", installed=True)
    except Exception as exc:  # noqa: BLE001 - only what stock DSD raises too
        assert isinstance(stock, Exception) and type(exc) is type(stock), (exc, stock)
        return
    if isinstance(stock, Exception):  # better than stock (torch's own load casts a str Enum as an iterable)
        assert type(got) is type(value) and got == value
    else:  # as stock (its flat layout flattens an OrderedDict into keys too)
        assert type(got) is type(stock) and got == stock


class NumpyStepAdamW(torch.optim.AdamW):
    """An optimizer whose own step keeps a numpy scalar in each parameter's state."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        for state in self.state.values():
            state["extra"] = np.float64(len(state))
        return out


@pytest.mark.parametrize("installed", [False, True])
@pytest.mark.parametrize("layout", ["flat", "nested"])
def test_a_fresh_optimizer_resumes_numpy_state_through_dsd_as_stock(
    layout: str, installed: bool, tmp_path: Path
) -> None:
    """A trainer's resume into a fresh optimizer (no state yet: `dsd.install()` plans its target from
    the checkpoint) of a checkpoint whose state holds numpy scalars: as stock DSD, every value back
    with its type."""
    options = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")

    def build(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2))
        opt = NumpyStepAdamW(model.parameters(), lr=0.01)
        for _ in range(steps):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
        return model, opt

    if installed:
        dsd.install()
    try:
        model, opt = build(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (installed: the save goes to torch's DSD, one warning)
            sd = dsd_stock.get_optimizer_state_dict(model, opt, options=options)
        dcp.save({"optim": sd}, checkpoint_id=tmp_path)
        model2, opt2 = build(0)
        target = {"optim": dsd_stock.get_optimizer_state_dict(model2, opt2, options=options)}
        dcp.load(target, checkpoint_id=tmp_path)
        dsd_stock.set_optimizer_state_dict(model2, opt2, target["optim"], options=options)
    finally:
        if installed:
            dsd.uninstall()
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert type(opt2.state[p2]["extra"]) is np.float64 and opt2.state[p2]["extra"] == opt.state[p]["extra"]
        assert_deep_equal(opt2.state[p2]["step"], opt.state[p]["step"])
