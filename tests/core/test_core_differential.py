"""Differential tests: the C++ core ``sparse_ckpt._C`` against the Python reference ``_core_py``.

Every test calls the same function of both backends on the same inputs and requires the same
outcome: equal results (dict key order, types, float bit patterns, tensors included) or the same
exception type and message. Inputs are random (hypothesis, derandomized for CI) or hand-written
edge cases: shared/duplicate parameters, every codec value type, NaN/-0.0, huge ints, unicode and
surrogates, over-deep nesting, bad ids, foreign parameters, corrupt/truncated tables. The decoders'
fuzzing (both cores agree on random and mutated inputs) is in tests/load/test_bad_checkpoints.py.

The module runs once (not once per backend): it overrides the suite's ``core_backend`` fixture
with a single ``cpp`` param, so ``-k cpp`` selects these tests too.
It is skipped when ``_C`` is not built, unless ``SPARSE_CKPT_REQUIRE_CPP`` is set (CI).
"""

from __future__ import annotations

import array
import collections
import copy
import enum
import gc
import math
import random
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import _backends
import numpy as np
import pytest
import torch
from helpers import same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from table_bytes import group, tab, u16, u32, v_tensor
from table_bytes import s as sstr

from sparse_ckpt import _core_py as P
from sparse_ckpt._core_py import common, module_walk, table_codec
from sparse_ckpt._format.keys import KEYS_ENTRY, STRIPPED_PARTS
from sparse_ckpt._format.tensor_parts import name_to_value, parts_to_tensor, tensor_to_parts, value_to_name
from sparse_ckpt._layouts.bucketed import _Geometry, _Names
from sparse_ckpt._save.save import _CPU_DTYPES as CPU_DTYPES
from sparse_ckpt.errors import CheckpointFormatError, CheckpointMismatchError

C = _backends.cpp_core()  # (skips the module where _C is not built, unless SPARSE_CKPT_REQUIRE_CPP)

FUNCTIONS = (
    "map_parameters",
    "fqn_tables",
    "pack_optimizer",
    "remap_to_fqns",
    "flatten_state",
    "flatten_packed_state",
    "flatten_groups",
    "unflatten",
    "encode_settings",
    "encode_table",
    "decode_table",
    "match_groups",
    "assign_state_ids",
    "encode_layout",
    "decode_layout",
    "plan_scatter",
    "crc32c",
    "gather_crc",
    "gather_many",
    "collect_plain",
)

PROPS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


core_backend = _backends.both_cores_directly
"""These tests call both cores directly: one run, id ``cpp`` (``-k cpp``, the sanitizer job, selects them)."""


# --------------------------------------------------------------------------- comparison


same = same_bits
"""Deep equality that also checks types, dict order, float bits and tensor bytes (helpers.same_bits)."""


def outcome(fn: Callable[..., Any], args: tuple) -> tuple:
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the exception itself is what we compare
        return ("err", type(exc), str(exc), exc.args)


def check(name: str, *args: Any, fresh: Callable[[], tuple] | None = None) -> tuple:
    """Run ``name`` on both cores and assert the same outcome; returns the Python outcome.

    ``fresh`` builds the arguments anew for each backend (for inputs a call may mutate).
    """
    py = outcome(getattr(P, name), fresh() if fresh else args)
    cc = outcome(getattr(C, name), fresh() if fresh else args)
    if py[0] == "ok" and cc[0] == "ok":
        assert same(py[1], cc[1]), f"{name}: results differ\npython: {py[1]!r}\ncpp:    {cc[1]!r}"
    else:
        assert py[0] == cc[0] and py[1] is cc[1] and py[2:] == cc[2:], (
            f"{name}: outcomes differ\npython: {py!r}\ncpp:    {cc!r}"
        )
    return py


def outside_contract(name: str, *args: Any, fresh: Callable[[], tuple] | None = None) -> str:
    """An input outside the core's contract (see ``_core_py``: lists/tuples, exact tuples for pairs,
    dicts, bytes, str): the C++ core raises TypeError or ValueError saying what it expected, never
    crashes or reads it another way. The Python core does what Python does; it is not compared."""
    with pytest.raises((TypeError, ValueError)) as info:
        getattr(C, name)(*(fresh() if fresh else args))
    assert "expected" in str(info.value), info.value
    return str(info.value)


def check_error(name: str, *args: Any, exc: type[BaseException], match: str | None = None) -> str:
    """Like :func:`check`, and the outcome must be an ``exc`` (message containing ``match``)."""
    result = check(name, *args)
    assert result[0] == "err" and issubclass(result[1], exc), result
    if match is not None:
        assert match in result[2], result[2]
    return result[2]


def settings_error(group_index: int, settings_: dict[Any, Any], *to_name: Any, match: str) -> str:
    """:func:`check_error` of ``encode_settings`` for leaf ``L``: a ``CheckpointFormatError`` containing ``match``."""
    return check_error(
        "encode_settings",
        "L",
        group_index,
        settings_,
        torch.Tensor,
        tensor_to_parts,
        *to_name,
        exc=CheckpointFormatError,
        match=match,
    )


def table_error(groups: list[Any], match: str) -> str:
    """:func:`check_error` of ``encode_table`` for leaf ``L``: a ``CheckpointFormatError`` containing ``match``."""
    return check_error(
        "encode_table", "L", groups, torch.Tensor, tensor_to_parts, exc=CheckpointFormatError, match=match
    )


# --------------------------------------------------------------------------- module surface


def test_module_surface() -> None:
    for name in FUNCTIONS:
        assert callable(getattr(C, name)), name
    assert (C.MAGIC, C.VERSION, C.MAX_DEPTH, C.PACKED_MARKER) == (P.MAGIC, P.VERSION, P.MAX_DEPTH, P.PACKED_MARKER)
    assert type(C.MAGIC) is bytes and type(C.PACKED_MARKER) is str


def test_keyword_arguments() -> None:
    groups = [({"lr": 0.1}, ["a"])]
    for mod in (P, C):
        out = mod.encode_table(leaf="l", groups_fqn=groups, tensor_type=torch.Tensor, to_parts=tensor_to_parts)
        assert mod.decode_table(leaf="l", data=out, from_parts=parts_to_tensor)[2] == [(0, ["a"])]


def test_core_leaves_gc_alone() -> None:
    """The cores never toggle the cyclic GC (the Python layer pauses it, thread-safely)."""
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            seen: list[bool] = []

            def from_parts(*a, seen=seen):
                seen.append(gc.isenabled())
                return parts_to_tensor(*a)

            C.decode_table("l", DECODE_CASES["tensor"], from_parts)
            with pytest.raises(CheckpointFormatError):
                C.flatten_state("l", {"a": 1}, {}, True)
            assert seen == [enabled] and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


# --------------------------------------------------------------------------- strategies

PARAMS = [torch.nn.Parameter(torch.full((2, i + 1), float(i))) for i in range(6)]
_uint16 = [torch.tensor([7, 8], dtype=torch.uint16)] if hasattr(torch, "uint16") else []
TENSORS = [
    torch.tensor(0.5),
    torch.tensor(float("nan")),
    torch.tensor([-0.0, 1.5], dtype=torch.float64),
    torch.tensor([1, -2, 3], dtype=torch.int32),
    torch.tensor(True),
    torch.zeros(0, 3),
    torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
    torch.ones(2, 2, dtype=torch.float16)[:, 0],
    torch.tensor([1 + 2j], dtype=torch.complex64),
    torch.tensor(200, dtype=torch.uint8),
    *_uint16,  # a dtype tensor_to_parts rejects: both cores must propagate its TypeError
]
HUGE_INTS = [2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, -(2**100), 10**30]
GOOD_TEXT = ["", "lr", "é", "日本語", "🙂 emoji", "a.b", "\x00nul", "params"]
BAD_TEXT = ["\ud800", "x\udfffy", "\udcff"]
BAD_VALUES = [set(), frozenset({1}), object(), 1 + 2j, bytearray(b"x"), {"a": 1}, range(3), Ellipsis, type]
BAD_KEYS = [1, None, float("nan"), b"lr", (1, 2), True, 2.5]

ints = st.one_of(st.integers(-(2**64), 2**64), st.sampled_from(HUGE_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-0.0, math.nan, -math.inf]))
texts = st.one_of(st.text(max_size=6), st.sampled_from(GOOD_TEXT))
good_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    floats,
    texts,
    st.binary(max_size=6),
    st.sampled_from(TENSORS[:-1] if _uint16 else TENSORS),
)
any_scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    texts,
    st.sampled_from(BAD_TEXT),
    st.binary(max_size=6),
    st.sampled_from(TENSORS),
    st.sampled_from(BAD_VALUES),
)


def _nest(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple))


good_values = st.recursive(good_scalars, _nest, max_leaves=5)
any_values = st.recursive(any_scalars, _nest, max_leaves=5)


@st.composite
def deep_values(draw: st.DrawFn) -> Any:
    """A scalar wrapped in 28..36 levels of tuples/lists (the limit is 32)."""
    value = draw(good_scalars)
    kinds = draw(st.sampled_from([(tuple,), (list,), (tuple, list)]))
    for level in range(draw(st.integers(28, 36))):
        value = kinds[level % len(kinds)]([value])
    return value


good_keys = st.one_of(st.text(max_size=5), st.sampled_from(GOOD_TEXT))
any_keys = st.one_of(good_keys, st.sampled_from(BAD_TEXT), st.sampled_from(BAD_KEYS))
good_settings = st.dictionaries(good_keys, good_values, max_size=4)
any_settings = st.dictionaries(any_keys, st.one_of(any_values, deep_values()), max_size=4)
fqn_names = st.one_of(
    st.text(alphabet="ab.0_", min_size=1, max_size=8), st.sampled_from(GOOD_TEXT), st.sampled_from(BAD_TEXT)
)


@st.composite
def groups_fqn(draw: st.DrawFn, settings_st: st.SearchStrategy = good_settings, names: st.SearchStrategy | None = None):
    """``[(settings, fqns)]`` with settings often repeated (exercises deduplication)."""
    if names is None:
        names = st.text(alphabet="abc.01_é", min_size=1, max_size=8)
    pool = draw(st.lists(settings_st, min_size=1, max_size=2))
    n = draw(st.integers(0, 4))
    return [(dict(draw(st.sampled_from(pool))), draw(st.lists(names, max_size=4))) for _ in range(n)]


# --------------------------------------------------------------------------- capture: pack + remap


@st.composite
def optimizer_inputs(draw: st.DrawFn) -> tuple[list[dict], dict]:
    """Param groups over a shared pool (duplicates within and across groups) and their state."""
    groups = []
    for _ in range(draw(st.integers(0, 4))):
        idx = draw(st.lists(st.integers(0, len(PARAMS) - 1), max_size=5))
        pairs = st.dictionaries(
            any_keys, st.one_of(st.integers(), st.sampled_from(BAD_VALUES + TENSORS[:2])), max_size=3
        )
        items = [kv for kv in draw(pairs).items() if kv[0] != "params"]
        items.insert(draw(st.integers(0, len(items))), ("params", [PARAMS[i] for i in idx]))
        groups.append(dict(items))
    state: dict[Any, Any] = {}
    for i in draw(st.lists(st.integers(0, len(PARAMS) - 1), unique=True, max_size=len(PARAMS))):
        state[PARAMS[i]] = {"step": torch.tensor(float(i)), "exp_avg": torch.zeros(2)}
    if draw(st.booleans()):
        state[draw(st.sampled_from(["extra", 0, 3, (1, 2)]))] = {"x": 1}
    return groups, state


@PROPS
@given(optimizer_inputs(), st.data())
def test_pack_and_remap(inputs: tuple[list[dict], dict], data: st.DataObject) -> None:
    groups, state = inputs
    res = check("pack_optimizer", "leaf", groups, state, torch.Tensor)
    if res[0] != "ok":
        return
    packed_groups, packed_state, id_to_param = res[1]
    owned = data.draw(st.lists(st.integers(0, len(PARAMS) - 1), unique=True))
    if data.draw(st.integers(0, 3)):  # usually every parameter is owned by the model
        owned = range(len(PARAMS))
    fqn_of = {id(PARAMS[i]): f"layer.{i}.weight" for i in owned}
    # post-hook style edits: reorder groups, corrupt an id, drop "params"
    packed_groups = [dict(g) for g in packed_groups]
    if packed_groups and data.draw(st.booleans()):
        packed_groups.reverse()
    if packed_groups and data.draw(st.integers(0, 4)) == 0:
        g = data.draw(st.sampled_from(packed_groups))
        g["params"] = [*g["params"], data.draw(st.sampled_from([-1, len(id_to_param), 2**70, "0", 1.0, True, None]))]
    if packed_groups and data.draw(st.integers(0, 6)) == 0:
        del data.draw(st.sampled_from(packed_groups))["params"]
    check("remap_to_fqns", "leaf", packed_groups, packed_state, id_to_param, fqn_of)


def test_pack_matches_torch_state_dict() -> None:
    a, b = PARAMS[0], PARAMS[1]
    opt = torch.optim.AdamW([{"params": [a, b]}, {"params": [PARAMS[2]], "lr": 0.5}])
    opt.state[b] = {"step": torch.tensor(3.0)}
    for mod in (P, C):
        groups, state, ids = mod.pack_optimizer("optim", opt.param_groups, opt.state, torch.Tensor)
        ref = opt.state_dict()
        assert same(groups, ref["param_groups"]) and same(state, ref["state"])
        assert ids == [a, b, PARAMS[2]] or all(x is y for x, y in zip(ids, [a, b, PARAMS[2]]))


def test_pack_duplicates_and_generic_iterables() -> None:
    a, b, c = PARAMS[:3]
    groups = [
        {"lr": 1, "params": [a, a, b]},
        {"params": (b, c), "wd": 0},
        collections.OrderedDict([("params", [c]), ("x", 1)]),
    ]
    res = check("pack_optimizer", "l", groups, {c: 1, a: 2, "k": 3}, torch.Tensor)
    assert res[0] == "ok" and res[1][0][0]["params"] == [0, 0, 2]
    check("pack_optimizer", "l", [], {}, torch.Tensor)
    # iterators are outside the contract (lists and tuples)
    outside_contract("pack_optimizer", "l", [{"params": iter([a, b])}], {}, torch.Tensor)
    outside_contract("pack_optimizer", "l", (g for g in [{"params": [a]}]), {}, torch.Tensor)
    # defaultdict state (torch's optimizer.state) takes the dict fast path
    check("pack_optimizer", "l", [{"params": [a, b]}], collections.defaultdict(dict, {b: {"s": 1}}), torch.Tensor)


@pytest.mark.parametrize(
    "groups, state",
    [
        ([{"lr": 1}], {}),  # no "params": KeyError
        ([{"params": [PARAMS[0]]}], {PARAMS[1]: {}}),  # state tensor in no group
        ([{"params": [PARAMS[0]]}], {torch.zeros(3, 1): {}}),  # plain tensor in no group
        ([{"params": [PARAMS[0]]}], {PARAMS[0]: {}}),  # fine
    ],
)
def test_pack_errors(groups: list, state: Any) -> None:
    check("pack_optimizer", "leaf", groups, state, torch.Tensor)


@pytest.mark.parametrize(
    "groups, state",
    [
        ([{"params": 5}], {}),  # params not a list
        ([5], {}),  # group not a dict
        ([{"params": [PARAMS[0]]}], 7),  # state not a dict
        ({"params": [PARAMS[0]]}, {}),  # groups not a list
    ],
)
def test_pack_outside_contract(groups: Any, state: Any) -> None:
    outside_contract("pack_optimizer", "leaf", groups, state, torch.Tensor)


def test_pack_bad_tensor_type() -> None:
    check_error("pack_optimizer", "l", [{"params": [PARAMS[0]]}], {PARAMS[0]: 1}, 5, exc=TypeError)


@pytest.mark.parametrize("bad_id", [-1, 3, 4, 2**70, -(2**70), "0", 1.0, True, None, 2])
def test_remap_bad_ids(bad_id: Any) -> None:
    a, b, c = PARAMS[:3]
    id_to_param = [a, b, None, c]  # id 2 was never assigned
    fqn_of = {id(a): "a", id(b): "b", id(c): "c"}
    for where in ("group", "state"):
        groups = [{"lr": 1, "params": [0, bad_id] if where == "group" else [0]}]
        state = {bad_id: {}} if where == "state" and not isinstance(bad_id, (list, dict)) else {}
        check("remap_to_fqns", "leaf", groups, state, id_to_param, fqn_of)


def test_remap_not_owned_and_other_errors() -> None:
    a, b = PARAMS[:2]
    ids = [a, b]
    msg = check_error("remap_to_fqns", "L", [{"params": [0, 1]}], {}, ids, {id(a): "a"}, exc=Exception)
    assert "is not owned by the model" in msg and "(2, 2)" in msg
    check_error(
        "remap_to_fqns",
        "L",
        [{"params": [0]}],
        {1: {}},
        ids,
        {id(a): "a"},
        exc=Exception,
        match="state: optimizer parameter",
    )
    check_error("remap_to_fqns", "L", [{"lr": 1}], {}, ids, {}, exc=CheckpointFormatError, match="no 'params'")
    check_error("remap_to_fqns", "L", [], {"k": 1}, ids, {}, exc=Exception, match="non-parameter key 'k'")
    check_error("remap_to_fqns", "L", [], {1.0: 1}, ids, {}, exc=Exception)
    check("remap_to_fqns", "L", [{"params": (0, 1)}], {0: {}, 1: {}}, ids, {id(a): ["unhashable"], id(b): "b"})
    # outside the contract: a group that is no dict, a Mapping that is no dict, ids not a list

    class M(Mapping):
        def __init__(self, d: dict) -> None:
            self.d = d

        def __getitem__(self, k: Any) -> Any:
            return self.d[k]

        def __iter__(self) -> Iterator:
            return iter(self.d)

        def __len__(self) -> int:
            return len(self.d)

    outside_contract("remap_to_fqns", "L", [5], {}, ids, {})
    outside_contract("remap_to_fqns", "L", [[0, "params"]], {}, ids, {})
    outside_contract("remap_to_fqns", "L", [{"params": (0, 1)}], {}, ids, M({id(a): "a", id(b): "b"}))
    outside_contract("remap_to_fqns", "L", [{"params": [0, 1]}], {}, tuple(ids), {id(a): "a", id(b): "b"})


# --------------------------------------------------------------------------- flat keys


state_values = st.recursive(
    st.one_of(st.integers(), st.sampled_from(TENSORS[:3]), st.none()),
    lambda inner: st.dictionaries(st.one_of(st.text(alphabet="ab.", max_size=3), st.integers(0, 3)), inner, max_size=3),
    max_leaves=4,
)


@PROPS
@given(
    st.dictionaries(
        st.one_of(st.text(alphabet="ab.é", max_size=4), st.integers(0, 3), st.sampled_from(BAD_TEXT)),
        st.one_of(st.dictionaries(st.text(alphabet="xy.", max_size=3), state_values, max_size=3), state_values),
        max_size=4,
    ),
    groups_fqn(st.dictionaries(any_keys, st.integers(), max_size=3), fqn_names),
)
def test_flatten(state_fqn: dict, groups: list) -> None:
    known = {"a", "b.x", "ab", "a.a"}
    for escape in (True, False):
        check("flatten_state", "l", state_fqn, known, escape)
        check("flatten_state", "l", collections.OrderedDict(reversed(list(state_fqn.items()))), known, escape)
    check("flatten_groups", "l", groups)


@PROPS
@given(
    st.dictionaries(
        st.sampled_from(["w", "w.x", "v"]),
        st.dictionaries(st.one_of(st.text(alphabet="a.~%s", max_size=4), st.integers(-3, 3)), state_values, max_size=3),
        max_size=3,
    )
)
def test_escaped_state_round_trips(state_fqn: dict) -> None:
    """Packed: any str/int state keys (dots, '~', '%', nesting that looks like another FQN) come back
    exactly from unflatten, on both cores; flat refuses exactly what it cannot hold."""
    known = {"w", "w.x", "v"}
    outcome_ = check("flatten_state", "l", state_fqn, known, True)
    if outcome_[0] != "ok":
        return
    flat = dict(outcome_[1])
    flat["param_groups.__packed__.l.0"] = b""  # any table: the dict is packed, parts are unescaped
    _settings, state_by, _tables, _scalars, unmatched = check("unflatten", flat, lambda _tables: known)[1]
    expected = {f: s for f, s in state_fqn.items() if _non_empty_leaves(s)}
    assert not unmatched
    assert same(state_by, expected), (state_by, expected)


def _non_empty_leaves(state: Any) -> bool:
    return not isinstance(state, dict) or any(_non_empty_leaves(v) for v in state.values())


def test_flatten_edge_cases() -> None:
    check_error(
        "flatten_state", "l", {"a": [1]}, {}, True, exc=CheckpointFormatError, match="is a list, expected a dict"
    )
    check("flatten_state", "l", {"a": collections.OrderedDict(b=1, c={"d": 2})}, {}, True)
    od = collections.OrderedDict(x=1, y=2)
    od.move_to_end("x")  # items() order differs from the dict storage order
    check("flatten_state", "l", {"w": {"s": od}}, {}, False)
    check("flatten_state", "l", {1.5: {None: 1, (1, 2): {"z": 3}}}, {}, True)
    outside_contract("flatten_state", "l", 5, {}, True)
    assert check("flatten_state", "l", {"w": {"ema.decay": 1, 7: 2, "~t": 3, "%": 4}}, {}, True)[1] == {
        "state.w.~sema%2Edecay": 1,
        "state.w.~i7": 2,
        "state.w.~s~t": 3,
        "state.w.%": 4,
    }
    check_error(
        "flatten_state",
        "l",
        {"w": {"ema.decay": 1}},
        {},
        False,
        exc=CheckpointFormatError,
        match="'ema.decay' of 'w' cannot be written in the flat format",
    )
    check_error("flatten_state", "l", {"w": {7: 1}}, {}, False, exc=CheckpointFormatError, match="7")
    check_error(
        "flatten_state",
        "l",
        {"w": {(1,): 1}},
        {},
        True,
        exc=CheckpointFormatError,
        match="is a tuple; state keys must be str or int",
    )
    check_error("flatten_state", "l", {"w": {"a": {}}}, {}, True, exc=CheckpointFormatError, match="empty dict")
    assert check("flatten_state", "l", {"x": {"exp_avg": {"b": 1}}}, {"x", "x.exp_avg"}, True)[1] == {
        "state.x.~sexp_avg.b": 1
    }
    check_error(
        "flatten_state",
        "l",
        {"x": {"exp_avg": {"b": 1}}},
        {"x", "x.exp_avg"},
        False,
        exc=CheckpointFormatError,
        match="would be read back as state of parameter 'x.exp_avg'",
    )
    check("flatten_groups", "l", [({"lr": 1}, ["a", "b"]), ({}, ["c"]), ({"x": 2}, [])])
    outside_contract("flatten_groups", "l", [({"lr": 1}, ["a"], "extra")])
    outside_contract("flatten_groups", "l", [({"lr": 1},)])
    outside_contract("flatten_groups", "l", [5])
    outside_contract("flatten_groups", "l", [([("lr", 1)], ["a"])])
    outside_contract("flatten_groups", "l", [[{"lr": 1}, ["a"]]])  # a pair is a tuple
    check_error("flatten_groups", "l", [({"my.lr": 1}, ["a"])], exc=CheckpointFormatError, match="group 0: setting key")
    check_error("flatten_groups", "l", [({3: 1}, ["a"])], exc=CheckpointFormatError, match="setting key 3")
    for part, match in (("~x", "invalid escaped part '~x'"), ("~i1x", "invalid escaped part")):
        check_error(
            "unflatten",
            {f"state.w.{part}": 1, "param_groups.__packed__.l.0": b""},
            {"w"},
            exc=CheckpointFormatError,
            match=match,
        )
    assert check("unflatten", {"state.w.~sa": 1}, {"w"})[1][1] == {"w": {"~sa": 1}}  # flat: never unescaped
    loop: dict = {}
    loop["self"] = loop
    for mod in (P, C):
        with pytest.raises(RecursionError):
            mod.flatten_state("l", {"a": loop}, {}, True)


@st.composite
def flat_dicts(draw: st.DrawFn) -> tuple[list[tuple[Any, Any]], list[str]]:
    """Items of an adversarial flat optimizer dict and the FQNs the model knows."""
    seg = st.sampled_from(["a", "b", "a.b", "w", "", "0", "__packed__", "state", "é"])
    path = st.lists(seg, min_size=0, max_size=4).map(".".join)
    key = st.one_of(
        path.map(lambda p: "state." + p),
        path.map(lambda p: "param_groups." + p),
        path.map(lambda p: "param_groups.__packed__." + p),
        path,
        st.sampled_from([1, None, b"state.a.x", ("state.a",)]),
    )
    value = st.one_of(
        st.integers(),
        st.binary(max_size=3),
        st.sampled_from(TENSORS[:2]),
        st.none(),
        st.dictionaries(st.sampled_from(["x", "y", "b"]), st.integers(), max_size=2),
    )
    items = draw(st.lists(st.tuples(key, value), max_size=8))
    known = draw(st.lists(path, max_size=4))
    return items, known


class _Known(Mapping):
    def __init__(self, keys: list[str]) -> None:
        self._d = dict.fromkeys(keys, "x")

    def __getitem__(self, k: str) -> str:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


@PROPS
@given(flat_dicts(), st.sampled_from(["dict", "set", "mapping", "list"]), st.sampled_from(["dict", "ordered"]))
def test_unflatten(spec: tuple[list, list], known_kind: str, flat_kind: str) -> None:
    items, known = spec

    def fresh() -> tuple:
        flat_items = copy.deepcopy(items)  # unflatten may nest into dict values of the input
        flat = dict(flat_items) if flat_kind == "dict" else collections.OrderedDict(flat_items)
        known_fqns = {
            "dict": lambda: {k: k for k in known},
            "set": lambda: set(known),
            "mapping": lambda: _Known(known),
            "list": lambda: list(known),
        }[known_kind]()
        return flat, known_fqns

    check("unflatten", fresh=fresh)


def test_unflatten_edge_cases() -> None:
    t = b"SCKT"
    cases = [
        {"state.a.x": 1, "state.a.x.y": 2},  # nests under a non-dict value
        {"state.a.x.y": 2, "state.a.x": 1},  # collides with nested state
        {"state.a.x": {}, "state.a.x.y": 2},  # nests into the input's dict value
        {"param_groups.__packed__.optim.abc": "notbytes"},
        {"param_groups.__packed__.optim.abc": bytearray(t)},
        {"param_groups.__packed__.": t, "param_groups.__packed__": 1},
        {"param_groups.": 1, "param_groups..x": 2, "param_groups.a.": 3, "param_groups.a.b.c": 4},
        {"state.": 1, "state..x": 2, "state.a": 3, "state.a.b.": 4, "other": 5, 7: 1},
        {"state.a.b.c.d": 1, "param_groups.a.b.lr": 0.1, "state.a.b.e": 2},
        {"state.x.y": 1, "param_groups.x.lr": 1, "state.nope.y": 2},
        {"state.\ud800.a": 1, "param_groups.\ud800.lr": 1},
    ]
    for flat in cases:
        check("unflatten", fresh=lambda flat=flat: (copy.deepcopy(flat), {"a": "a"}))
    outside_contract("unflatten", [("state.a.x", 1)], {})  # flat not a dict


def test_unflatten_never_writes_into_the_input() -> None:
    """A dict value that nested keys extend is copied first, on both cores (order of keys kept)."""
    for mod in (P, C):
        inner = {"x": 1, "deep": {"y": 2}}
        od = collections.OrderedDict(k=1)
        flat = {"state.w.a": inner, "state.w.a.b": 3, "state.w.a.deep.z": 4, "state.w.o": od, "state.w.o.q": 5}
        before = copy.deepcopy(flat)
        _settings, state, _tables, _scalars, _unmatched = mod.unflatten(flat, {"w": "w"})
        assert flat == before and inner == {"x": 1, "deep": {"y": 2}} and od == {"k": 1}
        assert state == {"w": {"a": {"x": 1, "deep": {"y": 2, "z": 4}, "b": 3}, "o": {"k": 1, "q": 5}}}
        assert type(state["w"]["o"]) is collections.OrderedDict and state["w"]["a"] is not inner
        untouched = mod.unflatten({"state.w.a": inner}, {"w": "w"})[1]
        assert untouched["w"]["a"] is inner  # values nobody extends are passed through as they are
    check("unflatten", fresh=lambda: ({"state.w.a": {"x": {}}, "state.w.a.x.y": 1, "state.w.a.x.z": 2}, {"w": 1}))


# --------------------------------------------------------------------------- scalar tables (packed v2)

_REQ_GRAD = torch.tensor(1.0, requires_grad=True)
SCALAR_CANDIDATES = [
    torch.tensor(3.0),
    torch.tensor(3.0),
    torch.tensor(4.0),
    torch.tensor(2, dtype=torch.int64),
    torch.tensor(1.5, dtype=torch.bfloat16),
    torch.tensor(float("nan")),
    torch.tensor(True),
    torch.tensor(1 + 2j, dtype=torch.complex64),
    torch.arange(4.0)[2],  # a 0-d view into a larger storage
    torch.zeros(2),
    torch.zeros(1, 1),
    torch.nn.Parameter(torch.tensor(1.0)),
    _REQ_GRAD,
    torch.tensor(7, dtype=torch.uint16) if _uint16 else torch.zeros(0),
    True,
    False,
    0,
    -(2**63),
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    0.5,
    -0.0,
    math.nan,
    math.inf,
    "s",
    None,
    b"x",
    (1,),
    [2],
    {"n": 1},
]
scalar_keys = st.one_of(
    st.sampled_from(["step", "eta", "mu", "", "a.b", "~x", "%", "é", "\ud800", "exp_avg"]),
    st.integers(-2, 2),
    st.sampled_from([None, 1.5, (1,)]),
)
scalar_states = st.dictionaries(scalar_keys, st.sampled_from(SCALAR_CANDIDATES), max_size=4)


def _scalar_parts(t: Any) -> Any:
    from sparse_ckpt._save.save import _scalar_parts as parts

    return parts(t)


@PROPS
@given(st.dictionaries(st.sampled_from(["w", "v", "w.x", "u", 3]), st.one_of(scalar_states, st.just({})), max_size=4))
def test_flatten_packed_state(state_fqn: dict) -> None:
    """Both cores hoist the same leading scalars; items plus hoisted scalars are flatten_state's output."""
    known = {"w", "v", "w.x", "u"}
    res = check("flatten_packed_state", "l", state_fqn, known, torch.Tensor, CPU_DTYPES, torch.strided, _scalar_parts)
    check(
        "flatten_packed_state",
        "l",
        collections.OrderedDict(reversed(list(state_fqn.items()))),
        known,
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )
    full = check("flatten_state", "l", state_fqn, known, True)
    assert res[0] == full[0]
    if res[0] != "ok":
        return
    items, groups = res[1]
    hoisted: dict[str, Any] = {}
    for scalars, fqns in groups:
        assert scalars and fqns and list(scalars)[-1] == KEYS_ENTRY
        for fqn in fqns:
            # the recorded keys are exactly this parameter's per-item keys, in order
            own = [k for k in P.flatten_state("l", {fqn: state_fqn[fqn]}, known, True) if k in items]
            recorded = [k.decode("utf-8", "surrogatepass") if type(k) is bytes else k for k in scalars[KEYS_ENTRY]]
            assert [f"state.{fqn}.{k}" for k in recorded] == own
            for key, value in scalars.items():
                if key != KEYS_ENTRY:
                    hoisted[f"state.{fqn}.{key}"] = value
    assert not set(hoisted) & set(items)
    assert same(dict(sorted({**hoisted, **items}.items())), dict(sorted(full[1].items())))
    for fqn, state in state_fqn.items():  # exactly the leading run went into the table
        run = []
        for key, value in state.items():
            if (
                table_codec.scalar_record("l", fqn, key, value, torch.Tensor, CPU_DTYPES, torch.strided, _scalar_parts)
                is None
            ):
                break
            run.append(key)
        in_groups = [list(s)[:-1] for s, fqns in groups if fqn in fqns]
        assert in_groups == ([run] if state else [])
    # distinct groups encode differently; encode_table of the groups round-trips on both cores
    blobs = [P.encode_settings("l", 0, s, torch.Tensor, tensor_to_parts) for s, _ in groups]
    assert len(set(blobs)) == len(blobs)
    if any(type(f) is not str for _s, fqns in groups for f in fqns):
        return  # encode_table refuses it (model FQNs are always str)
    enc = check("encode_table", "l", groups, torch.Tensor, tensor_to_parts)
    assert enc[0] == "ok"
    assert check("decode_table", "l", enc[1], parts_to_tensor)[1][2] == [(i, f) for i, (_s, f) in enumerate(groups)]


def test_flatten_packed_state_edge_cases() -> None:
    t = torch.tensor(5.0)
    adam = {"step": t, "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    items, groups = check(
        "flatten_packed_state",
        "l",
        {"a": adam, "b": dict(adam), "c": {"step": torch.tensor(6.0)}},
        {},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )[1]
    assert list(items) == ["state.a.exp_avg", "state.a.exp_avg_sq", "state.b.exp_avg", "state.b.exp_avg_sq"]
    assert [(list(s), f) for s, f in groups] == [(["step", KEYS_ENTRY], ["a", "b"]), (["step", KEYS_ENTRY], ["c"])]
    assert groups[0][0][KEYS_ENTRY] == ("exp_avg", "exp_avg_sq") and groups[1][0][KEYS_ENTRY] == ()
    assert groups[0][0]["step"] is t  # the saved value itself (encode_table copies it out)
    # only the leading run: a scalar after a non-scalar stays per item, in order
    items, groups = check(
        "flatten_packed_state",
        "l",
        {"w": {"n": 1, "m": torch.zeros(2), "k": 2}},
        {},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )[1]
    assert list(items) == ["state.w.m", "state.w.k"] and groups == [({"n": 1, KEYS_ENTRY: ("m", "k")}, ["w"])]
    # a parameter without scalars is listed too (its keys recorded); one whose state is {} is not
    items, groups = check(
        "flatten_packed_state",
        "l",
        {"a": {"m": 1.5j}, "b": {}, "c": {"e": {"x": [1]}, 7: 0.5j}},
        {},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )[1]
    assert groups == [({KEYS_ENTRY: ("m",)}, ["a"]), ({KEYS_ENTRY: ("e.x", "~i7")}, ["c"])]
    # keys that UTF-8 cannot encode still group (by their surrogate-passing bytes) on both cores
    _items, groups = check(
        "flatten_packed_state",
        "l",
        {"a": {"\ud800": [1]}, "b": {"\ud800": [2]}, "c": {"\udc00": [3]}},
        {},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )[1]
    assert [f for _s, f in groups] == [["a", "b"], ["c"]]
    # key order is part of a group's identity
    _items, groups = check(
        "flatten_packed_state",
        "l",
        {"a": {"x": 1, "y": 2}, "b": {"y": 2, "x": 1}},
        {},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )[1]
    assert len(groups) == 2
    # errors are flatten_state's, in the same order
    for bad in ({"a": [1]}, {"a": {"n": 1, "d": {}}}, {"a": {"n": 1, (1,): 2}}):
        assert (
            check("flatten_packed_state", "l", bad, {}, torch.Tensor, CPU_DTYPES, torch.strided, _scalar_parts)[2:]
            == check("flatten_state", "l", bad, {}, True)[2:]
        )
    check(
        "flatten_packed_state",
        "l",
        {"x": {"n": 1, "exp_avg": {"b": 1}}},
        {"x", "x.exp_avg"},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _scalar_parts,
    )
    for value in SCALAR_CANDIDATES:  # the CPU fast path gives exactly tensor_to_parts's parts
        if type(value) is torch.Tensor and _scalar_parts(value) is not None:
            assert _scalar_parts(value) == tensor_to_parts(value), value
    meta = torch.tensor(1.0).to("meta")
    assert _scalar_parts(meta) is None and _scalar_parts(torch.tensor(1.0).conj()) is not None
    assert (
        _scalar_parts(torch.tensor(1j).conj()) is None
        and _scalar_parts(torch.tensor(1.0, dtype=torch.float8_e4m3fn)) is None
    )
    loop: dict = {"n": 1}
    loop["self"] = loop
    for mod in (P, C):
        with pytest.raises(RecursionError):
            mod.flatten_packed_state("l", {"a": loop}, {}, torch.Tensor, CPU_DTYPES, torch.strided, _scalar_parts)


@pytest.mark.parametrize(
    "result",
    [
        None,
        ("float32", (), "cpu", b"\0" * 4),
        ("float32", (), "cpu"),
        5,
        ("\ud800", (), "cpu", b""),
        ("float32", (1.5,), "cpu", b""),
        ("float32", (), "cpu", 12),
        ("float32", (), "cpu", bytearray(b"abcd")),
        ValueError("boom"),
    ],
)
def test_flatten_packed_state_scalar_parts_results(result: Any) -> None:
    check(
        "flatten_packed_state",
        "l",
        {"w": {"step": TENSORS[0], "n": 1}},
        {},
        torch.Tensor,
        CPU_DTYPES,
        torch.strided,
        _parts(result),
    )


def test_flatten_packed_state_callback_mutates() -> None:
    def fresh() -> tuple:
        state = {"step": torch.tensor(1.0), "n": 1}

        def parts(t: Any) -> Any:
            state["new"] = 1
            return tensor_to_parts(t)

        return "l", {"w": state}, {}, torch.Tensor, CPU_DTYPES, torch.strided, parts

    check("flatten_packed_state", fresh=fresh)


def test_unflatten_scalar_tables() -> None:
    flat = {
        "state.__packed__.l.0": b"x",
        "param_groups.__packed__.l.1": b"y",
        "state.w.~i1": 2,
        "state.__packed__": 3,
        "state.w.__packed__.q": 4,
    }
    res = check("unflatten", fresh=lambda: (dict(flat), {"w": 1}))[1]
    assert res[3] == {"l.0": b"x"} and res[2] == {"l.1": b"y"}
    assert res[1] == {"w": {1: 2, "__packed__": {"q": 4}}} and res[4] == ["state.__packed__"]
    # scalar tables alone make the dict packed (escaped parts are decoded)
    assert check("unflatten", {"state.__packed__.l.0": b"", "state.w.~i1": 2}, {"w"})[1][1] == {"w": {1: 2}}
    for bad in ("notbytes", bytearray(b"x"), None, torch.zeros(1)):
        check_error(
            "unflatten",
            {"state.__packed__.l.0": bad},
            {},
            exc=CheckpointFormatError,
            match="scalar table 'state.__packed__.l.0' is a",
        )


# --------------------------------------------------------------------------- table codec


@PROPS
@given(groups_fqn(), st.sampled_from(["optim", "é", "exp\ud800"]))
def test_encode_decode_roundtrip(groups: list, leaf: str) -> None:
    res = check("encode_table", leaf, groups, torch.Tensor, tensor_to_parts)
    if res[0] == "ok":
        decoded = check("decode_table", leaf, res[1], parts_to_tensor)
        assert decoded[0] == "ok"
        _settings, _blobs, refs = decoded[1]
        assert [fqns for _, fqns in refs] == [fqns for _, fqns in groups]


@PROPS
@given(groups_fqn(any_settings, fqn_names), st.one_of(st.sampled_from(["optim", "", "é"]), st.sampled_from(BAD_KEYS)))
def test_encode_any_values(groups: list, leaf: Any) -> None:
    res = check("encode_table", leaf, groups, torch.Tensor, tensor_to_parts)
    if res[0] == "ok":
        check("decode_table", leaf, res[1], parts_to_tensor)
    for gi, (settings_, _fqns) in enumerate(groups):
        check("encode_settings", leaf, gi, settings_, torch.Tensor, tensor_to_parts)


@PROPS
@given(st.dictionaries(any_keys, st.one_of(any_values, deep_values()), max_size=6), st.sampled_from([0, 7, "g", None]))
def test_encode_settings(settings_: dict, group_index: Any) -> None:
    check("encode_settings", "leaf", group_index, settings_, torch.Tensor, tensor_to_parts)
    check("encode_settings", "leaf", group_index, collections.OrderedDict(settings_), torch.Tensor, tensor_to_parts)


@pytest.mark.parametrize("value", BAD_VALUES + [bytearray(), memoryview(b"x"), [1, {2}], (1, (2, object()))])
def test_encode_unsupported_value(value: Any) -> None:
    settings_error(3, {"k": value}, match="unsupported value type")


class _Sub:
    """Subclasses of the kinds the codec writes itself (each would decode as its base)."""

    class Float(float):
        pass

    class Int(int):
        pass

    class Str(str):
        pass

    class Bytes(bytes):
        pass

    class Tuple(tuple):
        pass

    class List(list):
        pass


_SUBCLASS_VALUES = [
    _Sub.Float(0.5),
    _Sub.Int(3),
    _Sub.Str("x"),
    _Sub.Bytes(b"x"),
    _Sub.Tuple((1, 2)),
    _Sub.List([1]),
    collections.namedtuple("Betas", "a b")(0.9, 0.99),
    enum.IntEnum("Mode", "A").A,
    enum.Enum("Kind", [("A", "a")], type=str).A,
    np.float64(0.25),
    [1, (2, np.float64(3.0))],
]


@pytest.mark.parametrize("value", _SUBCLASS_VALUES, ids=lambda v: type(v).__name__)
def test_encode_refuses_subclass_values_alike(value: Any) -> None:
    """Both cores refuse a value of a subclass of int/float/str/bytes/tuple/list with the same
    message naming its type and base (it would decode as the base type)."""
    message = settings_error(3, {"k": value}, match="leaf 'L' group 3 key 'k': a value of type ")
    assert re.search(r"a value of type [\w.<>]+ \(a subclass of \w+\) would load back as a plain \w+", message), message
    table_error([({"k": 1}, ["a"]), ({"k": value}, ["b"])], match="leaf 'L' group 1 key 'k': a value of type ")


@pytest.mark.parametrize("key", BAD_KEYS)
def test_encode_non_string_key(key: Any) -> None:
    settings_error(0, {"ok": 1, key: 2}, match="is not a string")
    table_error([({"ok": 1}, ["a"]), ({key: 2}, ["b"])], match="group 1: setting key")


@pytest.mark.parametrize("value", HUGE_INTS + [True, False, 0, -1])
def test_encode_int_range(value: int) -> None:
    check("encode_settings", "L", 0, {"k": value, "t": (1, [value])}, torch.Tensor, tensor_to_parts)


@pytest.mark.parametrize("where", ["key", "value", "nested", "fqn", "leaf"])
@pytest.mark.parametrize("text", BAD_TEXT)
def test_encode_surrogates(where: str, text: str) -> None:
    settings_ = {text: 1} if where == "key" else {"k": text} if where == "value" else {"k": (1, [text])}
    if where in ("fqn", "leaf"):
        settings_ = {"k": 1}
    fqns = ["ok", text] if where == "fqn" else ["ok"]
    leaf = text if where == "leaf" else "L"
    res = check("encode_table", leaf, [(settings_, fqns)], torch.Tensor, tensor_to_parts)
    if where != "leaf":
        assert res[0] == "err" and res[1] is CheckpointFormatError
        assert "string is not valid unicode (surrogates not allowed)" in res[2]


@pytest.mark.parametrize("depth", [30, 31, 32, 33, 34, 40])
@pytest.mark.parametrize("kind", [tuple, list])
def test_encode_depth_limit(depth: int, kind: type) -> None:
    value: Any = None
    for _ in range(depth):
        value = kind([value])
    res = check("encode_settings", "L", 0, {"k": value}, torch.Tensor, tensor_to_parts)
    assert (res[0] == "ok") == (depth <= 32), res
    if res[0] == "ok":
        check(
            "decode_table",
            "L",
            P.encode_table("L", [({"k": value}, [])], torch.Tensor, tensor_to_parts),
            parts_to_tensor,
        )


def test_encode_table_shapes() -> None:
    check("encode_table", "L", [], torch.Tensor, tensor_to_parts)
    check("encode_table", "L", [({}, [])], torch.Tensor, tensor_to_parts)
    check("encode_table", "L", [({"a": 1}, ["x"]), ({"a": 1}, ["y"]), ({"a": 2}, [])], torch.Tensor, tensor_to_parts)
    check("encode_table", "L", [({"a": 1}, ["x", 3])], torch.Tensor, tensor_to_parts)
    check("encode_table", "L", [({"a": 1}, ["x", None])], torch.Tensor, tensor_to_parts)
    check("encode_table", "L", [({"a": 1}, ("x", "y"))], torch.Tensor, tensor_to_parts)
    check("encode_table", "L", [(collections.OrderedDict(b=1, a=2), ["x"])], torch.Tensor, tensor_to_parts)
    for groups in (
        [({"a": 1}, "xy")],
        [({"a": 1}, 5)],
        [({"a": 1}, ["x"], 1)],
        [({"a": 1},)],
        [7],
        7,
        [([1, 2], ["x"])],
        (g for g in [({"a": 1}, ["x"])]),
    ):
        outside_contract("encode_table", "L", groups, torch.Tensor, tensor_to_parts)
    outside_contract("encode_settings", "L", 0, [("a", 1)], torch.Tensor, tensor_to_parts)
    outside_contract("encode_settings", "L", 0, 5, torch.Tensor, tensor_to_parts)
    check("encode_settings", "L", 0, {"k": PARAMS[0]}, 5, tensor_to_parts)  # bad tensor_type


def _parts(result: Any) -> Callable[[Any], Any]:
    def to_parts(t: Any) -> Any:
        if isinstance(result, BaseException):
            raise result
        return result

    return to_parts


@pytest.mark.parametrize(
    "result",
    [
        ("float32", (2,), "cpu", b"\0" * 8),
        ("float32", [2], "cpu", b"\0" * 8),
        ("\ud800", (2,), "cpu", b""),
        ("float32", (2,), "\udcff", b""),
        ("float32", (-(2**63),), "cpu", b""),
        ("float32", (True, -1), "cpu", b""),
        ValueError("boom"),
        CheckpointFormatError("inner"),
    ],
)
def test_encode_to_parts_results(result: Any) -> None:
    tensor = TENSORS[0]
    check("encode_settings", "L", 0, {"lr": tensor, "t": (1, tensor)}, torch.Tensor, _parts(result))
    check("encode_table", "L", [({"lr": tensor}, ["p"])], torch.Tensor, _parts(result))


@pytest.mark.parametrize(
    "result",
    [
        ("float32", (2,), "cpu"),
        ("float32", (2,), "cpu", b"", 5),
        ["float32", (2,), "cpu", b"\0" * 8],
        None,
        5,
        (5, (2,), "cpu", b""),
        (b"float32", (2,), "cpu", b""),
        ("float32", (1.5,), "cpu", b""),
        ("float32", (2**63,), "cpu", b""),
        ("float32", 5, "cpu", b""),
        ("float32", None, "cpu", b""),
        ("float32", (2,), "cpu", 12),
        ("float32", (2,), "cpu", "abc"),
        ("float32", (2,), "cpu", memoryview(array.array("i", [1, 2]))),
        ("float32", (2,), "cpu", bytearray(b"abcd")),
        iter(("float32", (1,), "cpu", b"")),
    ],
)
def test_encode_to_parts_outside_contract(result: Any) -> None:
    """``to_parts`` returns ``(str, tuple or list of int64, str, bytes)``; anything else is a TypeError or
    ValueError of the C++ core."""
    tensor = TENSORS[0]
    outside_contract("encode_settings", "L", 0, {"lr": tensor, "t": (1, tensor)}, torch.Tensor, _parts(result))
    outside_contract("encode_table", "L", [({"lr": tensor}, ["p"])], torch.Tensor, _parts(result))


# --------------------------------------------------------------------------- named values (dtype, device)

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DEVICES = [
    torch.device("cpu"),
    torch.device("cuda", 1),
    torch.device("cuda"),
    torch.device("meta"),
    torch.device("hpu", 7),
    torch.device("xpu", 0),
]
named_scalars = st.one_of(good_scalars, st.sampled_from(ALL_DTYPES), st.sampled_from(DEVICES))
named_values = st.recursive(named_scalars, _nest, max_leaves=5)


@PROPS
@given(
    st.lists(
        st.tuples(st.dictionaries(good_keys, named_values, max_size=4), st.lists(good_keys, max_size=2)), max_size=3
    )
)
def test_named_values_round_trip(groups: list) -> None:
    """dtype and device settings (what VeOmni's anyprecision_adamw puts in its groups): the same
    bytes from both cores, version 2 exactly when a table holds one, decoded back to the same values."""
    res = check("encode_table", "l", groups, torch.Tensor, tensor_to_parts, value_to_name)
    assert res[0] == "ok", res
    named = any(value_to_name(v) is not None for v in _leaves([s for s, _ in groups]))
    assert res[1][4:6] == u16(table_codec.NAMED_VERSION if named else P.VERSION)
    decoded = check("decode_table", "l", res[1], parts_to_tensor, name_to_value)[1]
    for (settings_, _fqns), (idx, _f) in zip(groups, decoded[2]):
        assert same(decoded[0][idx], settings_) or any(isinstance(v, torch.Tensor) for v in _leaves([settings_]))


def _leaves(values: Any) -> Iterator[Any]:
    for v in values.values() if isinstance(values, dict) else values:
        if isinstance(v, (dict, list, tuple)):
            yield from _leaves(v)
        else:
            yield v


def test_every_torch_dtype_and_device_round_trips() -> None:
    groups = [
        ({"d": dt, "dev": DEVICES[i % len(DEVICES)], "both": (dt, [DEVICES[0]])}, [f"p{i}"])
        for i, dt in enumerate(ALL_DTYPES)
    ]
    res = check("encode_table", "l", groups, torch.Tensor, tensor_to_parts, value_to_name)
    settings_, _blobs, _groups = check("decode_table", "l", res[1], parts_to_tensor, name_to_value)[1]
    assert [s["d"] for s in settings_] == ALL_DTYPES and all(s["d"] is dt for s, dt in zip(settings_, ALL_DTYPES))
    assert [s["dev"] for s in settings_] == [g[0]["dev"] for g in groups]


def test_named_value_needs_to_name() -> None:
    """Without ``to_name`` (or when it says ``None``) a dtype is refused like any other value."""
    for to_name in ((), (None,), (lambda v: None,)):
        settings_error(
            2, {"m": torch.float32}, *to_name, match="leaf 'L' group 2 key 'm': unsupported value type dtype"
        )


@pytest.mark.parametrize(
    "name",
    [
        ("dtype",),
        ("dtype", 3),
        ("dtype", "x", 1),
        ["dtype", "x"],
        ("other", "x"),
        (b"dtype", "x"),
        ([1], "x"),
        "dtype",
        5,
        ("dtype", "\ud800"),
    ],
)
def test_to_name_results(name: Any) -> None:
    res = check("encode_settings", "L", 0, {"k": (1, object())}, torch.Tensor, tensor_to_parts, lambda v: name)
    assert res[0] == "err" and res[1] in (TypeError, CheckpointFormatError), res


def test_to_name_errors_propagate() -> None:
    def to_name(v: Any) -> Any:
        raise KeyError("mine")

    check_error(
        "encode_table",
        "L",
        [({"k": torch.float16}, [])],
        torch.Tensor,
        tensor_to_parts,
        to_name,
        exc=KeyError,
        match="mine",
    )


def _named_table(tag: int, text: bytes | str, version: int | None = None) -> bytes:
    version = table_codec.NAMED_VERSION if version is None else version
    return tab([u32(1) + sstr("k") + bytes([tag]) + sstr(text)], [], magic=P.MAGIC, version=version)


NAMED_DECODE_CASES = {
    "dtype": _named_table(10, "bfloat16"),
    "device": _named_table(11, "cuda:3"),
    "dtype in version 1": _named_table(10, "bfloat16", version=1),
    "device in version 1": _named_table(11, "cpu", version=1),
    "unknown dtype": _named_table(10, "float128"),
    "dtype not a dtype": _named_table(10, "Tensor"),
    "dtype dunder": _named_table(10, "__class__"),
    "dtype empty": _named_table(10, ""),
    "dtype bad utf8": _named_table(10, b"\xff"),
    "bad device": _named_table(11, "nosuchdevice:x"),
    "truncated dtype": _named_table(10, "bfloat16")[:-5],
    "tag 12": _named_table(12, "x"),
    "version 3": _named_table(10, "bfloat16", version=3),
}


@pytest.mark.parametrize("name", list(NAMED_DECODE_CASES))
def test_decode_named_cases(name: str) -> None:
    res = check("decode_table", "leaf", NAMED_DECODE_CASES[name], parts_to_tensor, name_to_value)
    ok = name in ("dtype", "device")
    assert (res[0] == "ok") == ok, res
    if not ok:
        assert res[1] is CheckpointFormatError, res


@pytest.mark.parametrize("error", [ValueError("bad"), CheckpointFormatError("own"), KeyError("k")])
def test_decode_from_name_errors(error: BaseException) -> None:
    def from_name(kind: str, text: str) -> Any:
        raise error

    res = check("decode_table", "leaf", NAMED_DECODE_CASES["dtype"], parts_to_tensor, from_name)
    assert res[0] == "err" and res[1] is CheckpointFormatError
    assert res[2] == "own" if isinstance(error, CheckpointFormatError) else "bad dtype 'bfloat16' (" in res[2]


# --------------------------------------------------------------------------- decode


HEADER = P.MAGIC + u16(P.VERSION)


def table(settings_blobs: list[bytes], groups: list[tuple[int, list[bytes | str]]], trailer: bytes = b"") -> bytes:
    """A table (``_core_py``'s magic and version) of settings blobs, ``(index, fqns)`` groups and a trailer."""
    return tab(settings_blobs, [group(idx, fqns) for idx, fqns in groups], magic=P.MAGIC, version=P.VERSION) + trailer


def one_value(value_bytes: bytes) -> bytes:
    """A table with one settings entry ``{"k": <raw value>}`` and no groups."""
    return table([u32(1) + sstr("k") + value_bytes], [])


DECODE_CASES = {
    "empty": b"",
    "short magic": b"SCK",
    "bad magic": b"XXXX\x01\x00" + u32(0) + u32(0),
    "no version": P.MAGIC + b"\x01",
    "version 2": P.MAGIC + struct.pack("<H", 2) + u32(0) + u32(0),
    "version 0": P.MAGIC + struct.pack("<H", 0),
    "ok empty": table([], []),
    "no group count": HEADER + u32(0),
    "huge settings count": HEADER + u32(0xFFFFFFFF) + u32(0),
    "huge keys count": HEADER + u32(1) + u32(0xFFFFFFFF) + u32(0),
    "huge group count": HEADER + u32(0) + u32(0x7FFFFFFF),
    "huge params count": table([u32(0)], []).removesuffix(u32(0)) + u32(1) + u32(0) + u32(0xFFFFFFFF),
    "huge string": HEADER + u32(1) + u32(1) + u32(0xFFFFFFF0) + b"k",
    "bad utf8 key": table([u32(1) + sstr(b"\xff\xfe") + b"\x00"], []),
    "surrogate utf8 key": table([u32(1) + sstr(b"\xed\xa0\x80") + b"\x00"], []),
    "bad utf8 fqn": table([u32(0)], [(0, [b"a\x80"])]),
    "duplicate key": table([u32(2) + sstr("k") + b"\x00" + sstr("k") + b"\x01"], []),
    "bad settings index": table([u32(0)], [(1, ["a"])]),
    "huge settings index": table([u32(0)], [(0xFFFFFFFF, ["a"])]),
    "trailing": table([u32(0)], [(0, ["a"])], trailer=b"\x00\x01"),
    "unknown tag": one_value(b"\x0a"),
    "tag 255": one_value(b"\xff"),
    "missing tag": table([u32(1) + sstr("k")], []),
    "int": one_value(b"\x03" + struct.pack("<q", -(2**63))),
    "short int": one_value(b"\x03\x01\x02"),
    "float nan": one_value(b"\x04" + struct.pack("<Q", 0x7FF8_0000_0000_1234)),
    "float -0": one_value(b"\x04" + struct.pack("<d", -0.0)),
    "short float": one_value(b"\x04\x00"),
    "str": one_value(b"\x05" + sstr("héllo")),
    "bad str": one_value(b"\x05" + sstr(b"\xc3")),
    "bytes": one_value(b"\x06" + sstr(b"\x00\xff")),
    "short bytes": one_value(b"\x06" + u32(10) + b"ab"),
    "huge sequence": one_value(b"\x07" + u32(0xFFFFFFFF)),
    "sequence": one_value(b"\x08" + u32(3) + b"\x00\x01\x02"),
    "nested 32": one_value((b"\x07" + u32(1)) * 32 + b"\x00"),
    "nested 33": one_value((b"\x07" + u32(1)) * 33 + b"\x00"),
    "nested 34": one_value((b"\x08" + u32(1)) * 34 + b"\x00"),
    "nested 40 truncated": one_value((b"\x07" + u32(1)) * 40),
    "tensor": one_value(v_tensor("float32", [2], struct.pack("<ff", 1.5, -0.0))),
    "tensor 0-d": one_value(v_tensor("int64", [], struct.pack("<q", 5))),
    "tensor empty": one_value(v_tensor("float32", [0, 3], b"")),
    "tensor bad dtype": one_value(v_tensor("float128", [1], b"\0" * 16)),
    "tensor size mismatch": one_value(v_tensor("float32", [3], b"\0" * 8)),
    "tensor negative dim": one_value(v_tensor("float32", [-1], b"")),
    "tensor huge dims": one_value(v_tensor("float32", [2**62, 4], b"")),
    "tensor huge ndim": one_value(b"\x09" + sstr("float32") + u32(0xFFFFFFFF)),
    "tensor huge nbytes": one_value(v_tensor("float32", [2], b"", nbytes=2**64 - 1)),
    "tensor bad device utf8": one_value(v_tensor("float32", [1], b"\0" * 4, device=b"\xff")),
    "tensor odd device": one_value(v_tensor("float32", [1], b"\0" * 4, device="nosuchdevice")),
    "tensor truncated dims": one_value(b"\x09" + sstr("float32") + u32(2) + b"\0" * 9),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_cases(name: str) -> None:
    data = DECODE_CASES[name]
    res = check("decode_table", "leaf", data, parts_to_tensor)
    if res[0] == "err":
        assert res[1] is CheckpointFormatError, res


def test_decode_every_prefix_and_bitflip() -> None:
    groups = [
        (
            {"lr": 0.1, "betas": (0.9, 0.999), "t": TENSORS[2], "s": "é", "b": b"\x00", "n": None, "l": [True, False]},
            ["a.w", "a.b"],
        ),
        ({"lr": torch.tensor(1e-3)}, []),
        (
            {"lr": 0.1, "betas": (0.9, 0.999), "t": TENSORS[2], "s": "é", "b": b"\x00", "n": None, "l": [True, False]},
            ["日本"],
        ),
    ]
    data = P.encode_table("optim", groups, torch.Tensor, tensor_to_parts)
    assert C.encode_table("optim", groups, torch.Tensor, tensor_to_parts) == data
    for n in range(len(data) + 1):
        check("decode_table", "optim", data[:n], parts_to_tensor)
    for pos in range(len(data)):
        for bit in (0, 3, 7):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            check("decode_table", "optim", bytes(flipped), parts_to_tensor)


@pytest.mark.parametrize("data", [bytearray(b"SCKT"), memoryview(b"SCKT"), "SCKT", None, 5])
def test_decode_not_bytes(data: Any) -> None:
    check_error("decode_table", "leaf", data, parts_to_tensor, exc=CheckpointFormatError, match="expected bytes")


class _Stop(BaseException):
    pass


@pytest.mark.parametrize(
    "error", [ValueError("bad"), TypeError("ty\ud800pe"), CheckpointFormatError("own"), KeyError("k"), _Stop("stop")]
)
def test_decode_from_parts_errors(error: BaseException) -> None:
    data = one_value(v_tensor("float32", [1], b"\0" * 4))

    def from_parts(*args: Any) -> Any:
        raise error

    if isinstance(error, _Stop):  # not an Exception: propagates unchanged from both cores
        for mod in (P, C):
            with pytest.raises(_Stop):
                mod.decode_table("leaf", data, from_parts)
    else:
        check("decode_table", "leaf", data, from_parts)


def test_decode_bytes_subclass_and_leaf_repr() -> None:
    class B(bytes):
        pass

    data = P.encode_table("x", [({"a": 1}, ["p"])], torch.Tensor, tensor_to_parts)
    check("decode_table", "x", B(data), parts_to_tensor)
    check("decode_table", ("odd", 1), b"nope", parts_to_tensor)
    check("decode_table", "\ud800", data[:-1], parts_to_tensor)


# --------------------------------------------------------------------------- load matching


@st.composite
def match_inputs(draw: st.DrawFn) -> tuple[list[list[str]], dict[str, Any]]:
    names = [f"p{i}" for i in range(8)]
    pool = [
        {"lr": 0.1, "wd": 0},
        {"lr": 0.1, "wd": 0},  # equal content, distinct object
        {"lr": 0.2, "wd": 0},
        {"lr": 0.1},
        {"lr": 0.1, "wd": 0, "x": 1},
        {"lr": 1, "wd": 0},  # int vs float: a type difference
        {"lr": torch.tensor([0.1, 0.2]), "wd": 0},  # == raises on bool(): falls back to identity
        {"lr": torch.tensor([0.1, 0.2]), "wd": 0},
        {"lr": torch.tensor(0.1), "wd": 0},
        {"wd": 0, "lr": 0.1},
    ]
    settings_of = {n: pool[draw(st.integers(0, len(pool) - 1))] for n in draw(st.lists(st.sampled_from(names)))}
    if draw(st.booleans()):
        settings_of.setdefault("p0", None)
    target = draw(st.lists(st.lists(st.sampled_from(names + ["missing"]), max_size=4), max_size=4))
    return target, settings_of


@PROPS
@given(match_inputs())
def test_match_groups(inputs: tuple[list[list[str]], dict]) -> None:
    target, settings_of = inputs
    check("match_groups", "leaf", target, settings_of)
    check("match_groups", "leaf", [tuple(g) for g in target], collections.OrderedDict(settings_of))
    state_by_fqn = {k: (None if v is None else {"step": v}) for k, v in settings_of.items()}
    check("assign_state_ids", target, state_by_fqn)


def test_match_groups_first_differing_key() -> None:
    a = {"lr": 0.1, "wd": 0}
    for b, key in [
        ({"lr": 0.1, "wd": 1}, "wd"),
        ({"lr": 0.1}, "wd"),
        ({"lr": 0.1, "wd": 0, "z": 2}, "z"),
        ({"lr": 0.1, "wd": 0.0}, "wd"),
        (dict(a), "?"),
        ({"wd": 0, "lr": 0.1}, "?"),
        ({"lr": float("nan"), "wd": 0}, "lr"),
    ]:
        msg = check_error("match_groups", "L", [["x", "y"]], {"x": a, "y": b}, exc=Exception)
        assert f"(key {key!r})" in msg, msg
    t1, t2 = {"lr": torch.ones(2)}, {"lr": torch.ones(2)}
    check_error("match_groups", "L", [["x"], ["y", "x"]], {"x": t1, "y": t2}, exc=Exception, match="(key 'lr')")
    check_error("match_groups", "L", [["x", "y"]], {"x": {1: 1}, "y": {2: 2}}, exc=Exception, match="(key 1)")
    check("match_groups", "L", [["x", ["unhashable"]]], {"x": a})
    outside_contract("match_groups", "L", [5], {})
    outside_contract("match_groups", "L", [["x", "y"]], {"x": a, "y": 5})


def test_assign_state_ids_edge_cases() -> None:
    s = {"step": 1}
    check("assign_state_ids", [["a", "b", "a"], ["b", "c"], []], {"a": s, "c": None, "b": {}})
    check("assign_state_ids", [["a", ["x"]]], {"a": s})
    check("assign_state_ids", [["a", {"x"}]], {"a": s})
    check("assign_state_ids", [("a", "b")], collections.OrderedDict(b=s))
    outside_contract("assign_state_ids", [iter(["a", "b"])], {"b": s})
    outside_contract("assign_state_ids", 5, {})


# --------------------------------------------------------------------------- parameter names

_BASES = (torch.nn.Module.named_modules, torch.nn.Module.named_parameters)
_STRIPPED = STRIPPED_PARTS


class _Wrapper(torch.nn.Module):
    """Stands in for DDP: its ``module`` child is left out of canonical names."""


class _OwnNamedModules(torch.nn.Module):
    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Module]]:
        return super().named_modules(*args, **kwargs)


class _OwnNamedParameters(torch.nn.Linear):
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return super().named_parameters(*args, **kwargs)


class _OddDict(dict):
    """A ``_modules``/``_parameters`` mapping with its own ``items`` (the generic path)."""

    def items(self):  # type: ignore[override]
        return list(super().items())


class _ModulesProperty(torch.nn.Module):
    """``_modules`` a property (a data descriptor: getattr never reads the instance dict's decoy)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("real", torch.nn.Linear(1, 1))  # Module.__setattr__ reads the instance dict's _modules
        self.__dict__["_modules"] = {"decoy": torch.nn.Linear(2, 2)}

    @property
    def _modules(self) -> dict[str, Any]:  # type: ignore[override]
        return self.__dict__["_real_modules"]

    @_modules.setter
    def _modules(self, value: dict[str, Any]) -> None:
        self.__dict__["_real_modules"] = value


class _OwnGetattribute(torch.nn.Linear):
    """Its own ``__getattribute__`` renames its parameters (the instance dict holds the plain names)."""

    def __init__(self) -> None:
        super().__init__(1, 1)
        self.__dict__["_renamed"] = True  # from here on (Linear's own __init__ reads its parameters)

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name == "_parameters" and super().__getattribute__("__dict__").get("_renamed"):
            return {f"g_{k}": v for k, v in value.items()}
        return value


class _StashedParameters(torch.nn.Linear):
    """No ``_parameters`` in the instance dict: ``__getattr__`` supplies it."""

    def __init__(self) -> None:
        super().__init__(1, 1)
        self.__dict__["_stash"] = self.__dict__.pop("_parameters")

    def __getattr__(self, name: str) -> Any:
        if name == "_parameters":
            return self.__dict__["_stash"]
        return super().__getattr__(name)


def _walk_models() -> dict[str, torch.nn.Module]:
    shared = torch.nn.Linear(2, 2)
    wrapped = _Wrapper()
    wrapped.module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    wrapped.module.add_module("_orig_mod", torch.nn.Linear(1, 1))
    outer = torch.nn.Module()
    outer.w = wrapped
    outer.module = torch.nn.Linear(1, 1)  # not under the wrapper: kept
    outer.register_parameter("_orig_mod", torch.nn.Parameter(torch.zeros(1)))  # a stripped param name
    outer.none_child = None
    outer.register_parameter("none_param", None)
    odd = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    odd._modules = _OddDict(odd._modules)
    odd[0]._parameters = _OddDict(odd[0]._parameters)
    nested_override = torch.nn.Sequential(torch.nn.Linear(1, 1), _OwnNamedModules())
    unicode = torch.nn.Module()
    unicode.add_module("ünï", torch.nn.Linear(1, 1))
    return {
        "plain": torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)),
        "shared": torch.nn.Sequential(shared, shared),
        "wrapped": outer,
        "odd_mappings": odd,
        "nested_override": nested_override,
        "own_named_parameters": _OwnNamedParameters(1, 1),
        "unicode": unicode,
        "empty": torch.nn.Module(),
        # how the walk reads each module's _parameters/_modules: always what getattr gives
        "modules_property": torch.nn.Sequential(_ModulesProperty()),
        "own_getattribute": torch.nn.Sequential(_OwnGetattribute()),
        "stashed_parameters": torch.nn.Sequential(_StashedParameters()),
    }


def _map(model: Any, wrapper: type | None, cached: tuple | None = None) -> tuple:
    """``map_parameters`` on both cores: the (common) outcome."""
    return check("map_parameters", model, _STRIPPED, wrapper, *_BASES, cached)


@pytest.mark.parametrize("name", list(_walk_models()))
@pytest.mark.parametrize("wrapper", [None, _Wrapper])
def test_map_parameters(name: str, wrapper: type | None) -> None:
    model = _walk_models()[name]
    res = _map(model, wrapper)
    assert res[0] == "ok"
    if name in ("nested_override", "own_named_parameters"):
        assert res[1] is None
        return
    memo, fqn_of, canonical, param_of = res[1]
    assert (memo is None) == (name == "odd_mappings")  # a mapping that is not an exact dict: no replay
    expected = P.fqn_tables(module_walk._walk(model, _STRIPPED, wrapper, *_BASES, module_walk._Trace()))
    assert same((fqn_of, canonical, param_of), expected)
    assert list(param_of.values()) == list(dict.fromkeys(p for _n, p in model.named_parameters(remove_duplicate=False)))
    if name == "wrapped":
        assert ("w.0.weight" in param_of) == (wrapper is _Wrapper) and "module.weight" in param_of and "" in param_of
    if memo is not None:  # an unchanged model replays the memo (either core's: they are the same bytes)
        for core in (P, C):
            again = core.map_parameters(model, _STRIPPED, wrapper, *_BASES, memo)
            assert again[0] is memo and again[1] is memo[5] and again[2] is memo[6]
            assert same(again[3], param_of) and all(a is b for a, b in zip(again[3].values(), param_of.values()))
        # another stripped set or wrapper: built anew
        other = _map(model, None if wrapper else _Wrapper, memo)[1]
        assert other[0] is not memo


def test_map_parameters_triples_are_named_parameters() -> None:
    for name, model in _walk_models().items():
        triples = module_walk._walk(model, _STRIPPED, None, *_BASES, module_walk._Trace())
        if triples is not None:
            assert [(r, p) for r, _c, p in triples] == list(model.named_parameters(remove_duplicate=False)), name
            # the identity trick: an unstripped canonical name is the raw str object itself
            assert all(c is r for r, c, _p in triples if "_orig_mod" not in r), name


def _mutations() -> dict[str, Callable[[torch.nn.Module], None]]:
    def tie(m: torch.nn.Module) -> None:
        m[1].weight = m[0].weight

    def rename(m: torch.nn.Module) -> None:
        m[0]._parameters = {"w2" if k == "weight" else k: v for k, v in m[0]._parameters.items()}

    def reorder(m: torch.nn.Module) -> None:
        m[0]._parameters = dict(reversed(list(m[0]._parameters.items())))

    def swap_children(m: torch.nn.Module) -> None:
        m._modules = {
            "0": m._modules["1"],
            "1": m._modules["0"],
            **{k: v for k, v in m._modules.items() if k not in "01"},
        }

    def wrap(m: torch.nn.Module) -> None:
        w = _Wrapper()
        w.module = m[0]
        m[0] = w

    def plain_child_named_module(m: torch.nn.Module) -> None:
        m[0].add_module("module", torch.nn.Linear(1, 1))

    def odd(m: torch.nn.Module) -> None:
        m._modules = _OddDict(m._modules)

    return {
        "replace_param": lambda m: setattr(m[0], "weight", torch.nn.Parameter(torch.zeros(3, 2))),
        "direct_dict_write": lambda m: m[0]._parameters.__setitem__("bias", torch.nn.Parameter(torch.zeros(3))),
        "add_param": lambda m: m[2].register_parameter("extra", torch.nn.Parameter(torch.zeros(1))),
        "none_param": lambda m: m[0].register_parameter("bias", None),
        "delete_param": lambda m: delattr(m[0], "bias"),
        "rename_param": rename,
        "reorder_params": reorder,
        "tie": tie,
        "add_module": lambda m: m.append(torch.nn.Linear(1, 1)),
        "delete_module": lambda m: m.__delitem__(2),
        "replace_module": lambda m: m.__setitem__(2, torch.nn.Linear(3, 1)),
        "swap_children": swap_children,
        "wrap": wrap,
        "child_named_module": plain_child_named_module,
        "stripped_name": lambda m: m.add_module("_orig_mod", torch.nn.Linear(1, 1)),
        "odd_mapping": odd,
        "override_named_modules": lambda m: m.__setitem__(1, _OwnNamedModules()),
    }


@pytest.mark.parametrize("mutation", list(_mutations()))
@pytest.mark.parametrize("wrapper", [None, _Wrapper])
def test_map_parameters_replay_sees_every_change(mutation: str, wrapper: type | None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    memo = _map(model, wrapper)[1][0]
    _mutations()[mutation](model)
    res = _map(model, wrapper, memo)
    fresh = _map(model, wrapper)
    assert res[0] == fresh[0] == "ok"
    if fresh[1] is None:
        assert res[1] is None
        return
    assert res[1][0] is not memo
    assert same(res[1], fresh[1])
    public = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    assert list(res[1][3].values()) == list(dict.fromkeys(p for _n, p in public))


def test_map_parameters_replays_ordered_dict_containers() -> None:
    """``del seq[i]`` leaves ``_modules`` an ``OrderedDict``: still replayed (in items() order), and
    a ``move_to_end`` (items() order changes, the dict's storage order does not) is seen."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1), torch.nn.Linear(1, 1))
    del model[1]
    assert type(model._modules) is collections.OrderedDict
    memo = _map(model, None)[1][0]
    assert memo is not None
    for core in (P, C):
        assert core.map_parameters(model, _STRIPPED, None, *_BASES, memo)[0] is memo
    model._modules.move_to_end("0")
    res = _map(model, None, memo)[1]
    assert res[0] is not memo and list(res[3]) == [n for n, _ in model.named_parameters()]


def test_map_parameters_memo_holds_no_module_or_parameter() -> None:
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    memo = _map(model, None)[1][0]
    refs = [weakref.ref(model[1]), weakref.ref(model[1].weight)]
    del model[1]
    gc.collect()
    assert all(r() is None for r in refs)
    assert _map(model, None, memo)[1][0] is not memo


def test_map_parameters_errors() -> None:
    check_error("map_parameters", object(), _STRIPPED, None, *_BASES, None, exc=AttributeError)
    broken = torch.nn.Linear(1, 1)
    broken.__dict__["_parameters"] = 5
    check_error("map_parameters", broken, _STRIPPED, None, *_BASES, None, exc=AttributeError)
    bad_stripped = torch.nn.Linear(1, 1)
    check_error("map_parameters", bad_stripped, 5, None, *_BASES, None, exc=TypeError)
    check_error("map_parameters", bad_stripped, _STRIPPED, None, *_BASES, (1, 2), exc=TypeError, match="not a memo")
    memo = _map(bad_stripped, None)[1][0]
    forged = (*memo[:2], "words", *memo[3:])
    check_error("map_parameters", bad_stripped, _STRIPPED, None, *_BASES, forged, exc=TypeError, match="not a memo")
    truncated = (*memo[:2], memo[2][:-8], *memo[3:])
    assert _map(bad_stripped, None, truncated)[1][0] is not truncated


def test_fqn_tables_first_wins_and_errors() -> None:
    a, b = torch.zeros(1), torch.zeros(2)
    res = check("fqn_tables", [("x.w", "w", a), ("y.w", "w2", a), ("z", "z", b), ("w", "w", b)])
    fqn_of, canonical, param_of = res[1]
    assert fqn_of == {id(a): "w", id(b): "z"} and list(param_of) == ["w", "z"]
    assert canonical == {"w": "w", "x.w": "w", "w2": "w", "y.w": "w", "z": "z"}
    outside_contract("fqn_tables", iter([("a", "a", a)]))
    for named in ([("a", "a")], [("a", "a", a, 1)], [5], 5, [["a", "a", a]]):
        outside_contract("fqn_tables", named)
    check_error("fqn_tables", [(["unhashable"], "a", a)], exc=TypeError)


# --------------------------------------------------------------------------- end to end


def test_end_to_end_with_real_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": params[:2], "lr": torch.tensor(0.01)}, {"params": params[2:], "betas": (0.8, 0.9)}],
        weight_decay=0.0,
    )
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    fqn_of = {id(p): n for n, p in model.named_parameters()}
    res = check("pack_optimizer", "optim", opt.param_groups, opt.state, torch.Tensor)
    groups, state, ids = res[1]
    groups_fqn_, state_fqn = check("remap_to_fqns", "optim", groups, state, ids, fqn_of)[1]
    blob = check("encode_table", "optim", groups_fqn_, torch.Tensor, tensor_to_parts)[1]
    check("decode_table", "optim", blob, parts_to_tensor)
    flat = {
        **check("flatten_state", "optim", state_fqn, set(fqn_of.values()), True)[1],
        **check("flatten_groups", "optim", groups_fqn_)[1],
    }
    flat[f"param_groups.__packed__.optim.{len(blob)}"] = blob
    known = {n: n for n in fqn_of.values()}
    _settings, state_by_fqn, _tables, _scalars, _unmatched = check("unflatten", flat, known)[1]
    target = [list(fqns) for _, fqns in groups_fqn_]
    check("assign_state_ids", target, state_by_fqn)


def test_flatten_packed_state_cpu_fast_path_matches_scalar_parts() -> None:
    """The core's own read of a plain CPU 0-d tensor gives the bytes the ``scalar_parts`` callback
    would: the same scalar groups and the same encoded table with and without ``cpu_dtypes``."""
    values = [torch.tensor(v, dtype=dt) for dt in CPU_DTYPES for v in (0, 1, 3)]
    values += [torch.arange(4.0)[2], torch.tensor(-0.0), torch.tensor(float("nan")), torch.tensor(5.0).neg()]
    state = {f"p{i}": {"step": v, "m": torch.zeros(2)} for i, v in enumerate(values)}
    calls: list[Any] = []

    def counting(t: Any) -> Any:
        calls.append(t)
        return _scalar_parts(t)

    for core in (P, C):
        calls.clear()
        fast = core.flatten_packed_state("l", state, {}, torch.Tensor, CPU_DTYPES, torch.strided, counting)
        n_fast = len(calls)
        slow = core.flatten_packed_state("l", state, {}, torch.Tensor, {}, torch.strided, counting)
        assert n_fast < len(calls) == len(values)
        assert same(fast, slow)
        assert core.encode_table("l", fast[1], torch.Tensor, tensor_to_parts) == core.encode_table(
            "l", slow[1], torch.Tensor, tensor_to_parts
        )


def test_lengths_over_u32_are_format_errors() -> None:
    """A length the table format cannot hold (over 2**32 - 1) is the library's error, not
    struct.error (the Python core's helper; csrc/common.cpp put_len_u32 raises the same message --
    a 4 GiB value is no test input)."""
    msg = re.escape("length 4294967296 does not fit the table format (at most 4294967295)")
    with pytest.raises(CheckpointFormatError, match=msg):
        common.len32(2**32)
    assert common.len32(2**32 - 1) == b"\xff\xff\xff\xff"


# ----------------------------------------------------------- layout codec: random and hostile tables, both cores agree

_LAYOUT_HEADER = b"SCKL\x01\x00"


def _layout_tokens(rnd: random.Random) -> bytes:
    """A random stream of layout-table pieces: counts, strings, dims (small, huge, negative)."""
    out = bytearray()
    for _ in range(rnd.randint(0, 14)):
        kind = rnd.randrange(5)
        if kind == 0:
            out += rnd.choice([0, 1, 2, 3, 2**32 - 1]).to_bytes(4, "little")
        elif kind == 1:
            text = rnd.choice([b"p", b"exp_avg", b"float32", b"\xff", b""])
            out += len(text).to_bytes(4, "little") + text
        elif kind == 2:
            out += rnd.choice([0, 1, 2, 4, 6, 2**62, 2**63 - 1, 2**64 - 2]).to_bytes(8, "little")
        elif kind == 3:
            out += rnd.choice([0, 1, 3, -1, 2**62, -(2**63)]).to_bytes(8, "little", signed=True)
        else:
            out += rnd.randbytes(rnd.randint(0, 6))
    return bytes(out)


@PROPS
@given(st.binary(max_size=48), st.integers(0, 2**32 - 1))
def test_layout_decoders_agree_on_any_bytes(data: bytes, seed: int) -> None:
    """decode_layout and plan_scatter on random bytes and random token streams: the two cores give
    the same result or the same exception type and message; a defect is only ever a format error."""
    rnd = random.Random(seed)
    chunk = rnd.choice([None, ((6, 2), (0, 0), (6, 2)), ((4,), (1,), (3,)), ((2**62,), (0,), (2**62,))])
    for table in (
        data,
        _LAYOUT_HEADER + data,
        _LAYOUT_HEADER + _layout_tokens(rnd),
        _LAYOUT_HEADER + _layout_tokens(rnd),
    ):
        for result in (
            check("decode_layout", "leaf", table),
            check("plan_scatter", "leaf", [table, table], lambda f, c=chunk: c),
        ):
            assert result[0] == "ok" or result[1] in (CheckpointFormatError, CheckpointMismatchError), result


@PROPS
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from([0, 1, 3, 2**31, 2**62, 2**63 - 1]),
            st.sampled_from([1, 2, 4, 8, 16]),
        ),
        max_size=5,
    ),
    st.sampled_from([1, 64, 2**62, 2**100]),
)
def test_encode_layout_agrees_on_huge_counts(chunks: list[tuple[str, int, int]], bucket_bytes: int) -> None:
    """Chunks up to 2**63-1 elements in one bucket: the cores agree (results, or the format error of
    a bucket over 2**63-1 elements), never a raw struct.error."""
    ents = [(f"{name}{i}", "k", "float32", size, (n,), (0,), (n,)) for i, (name, n, size) in enumerate(chunks)]
    result = check("encode_layout", "leaf", ents, bucket_bytes)
    assert result[0] == "ok" or result[1] is CheckpointFormatError, result
    if result[0] == "ok":
        assert all(numel <= 2**63 - 1 for _d, numel, _m in result[1][1])


# --------------------------------------------------------------------------- crc32c


def _crc32c_reference(data: bytes, value: int = 0) -> int:
    """CRC-32C bit by bit (reflected polynomial 0x82F63B78): what both cores must give."""
    reg = value ^ 0xFFFFFFFF
    for b in data:
        reg ^= b
        for _ in range(8):
            reg = (reg >> 1) ^ 0x82F63B78 if reg & 1 else reg >> 1
    return reg ^ 0xFFFFFFFF


def test_crc32c_known_values() -> None:
    """The standard check value, the empty input, and continuation (``crc32c(b + c) == crc32c(c, crc32c(b))``)."""
    assert check("crc32c", b"123456789") == ("ok", 0xE3069283)
    assert check("crc32c", b"") == ("ok", 0)
    assert check("crc32c", b"", 0x1234) == ("ok", 0x1234)
    mid = random.Random(2).randbytes(1 << 16 | 77)  # the numpy block path of the twin
    assert check("crc32c", mid) == ("ok", _crc32c_reference(mid))
    big = random.Random(3).randbytes(1 << 20 | 77)  # and the C++ core without the GIL
    whole = check("crc32c", big)
    assert check("crc32c", big[1000:], check("crc32c", big[:1000])[1]) == whole
    assert check("crc32c", bytearray(big)) == whole and check("crc32c", memoryview(big)) == whole


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("size", [3 * 4096 - 1, 3 * 4096, 3 * 4096 + 8, 6 * 4096 + 13])
def test_crc32c_across_lane_groups(size: int, start: int) -> None:
    """Inputs around whole groups of the C++ core's three 4 KiB lanes, from an aligned and a misaligned
    start: both cores give the bitwise reference, from zero and continued."""
    data = random.Random(size + start).randbytes(size + start)[start:]
    for value in (0, 0x9E3779B9):
        assert check("crc32c", memoryview(data), value) == ("ok", _crc32c_reference(data, value))


@PROPS
@given(st.binary(max_size=20000), st.integers(0, 2**32 - 1), st.integers(0, 40))
def test_crc32c_agrees_with_the_reference(data: bytes, value: int, cut: int) -> None:
    """Any bytes, any starting value: both cores give the bitwise reference CRC-32C, as bytes, bytearray and
    memoryview (also of a multi-byte format and a 2-d shape)."""
    expected = _crc32c_reference(data, value)
    assert check("crc32c", data, value) == ("ok", expected)
    assert check("crc32c", bytearray(data), value) == ("ok", expected)
    assert check("crc32c", memoryview(data)[cut:], value) == ("ok", _crc32c_reference(data[cut:], value))
    words = data[: len(data) // 4 * 4]
    if words:
        shaped = memoryview(words).cast("I").cast("B").cast("I", (len(words) // 4, 1))
        assert check("crc32c", shaped) == ("ok", _crc32c_reference(words))


def test_crc32c_errors() -> None:
    """The same TypeError/ValueError and message from both cores for each refusal."""
    check_error("crc32c", "text", exc=TypeError, match="expected bytes, bytearray or memoryview, got str")
    check_error("crc32c", np.zeros(4, np.uint8), exc=TypeError, match="got ndarray")
    check_error("crc32c", memoryview(bytes(16)).cast("B", (4, 4))[::2], exc=ValueError, match="C-contiguous")
    check_error("crc32c", b"x", 1.0, exc=TypeError, match="expected value as an int, got float")
    check_error("crc32c", b"x", True, exc=TypeError, match="got bool")
    check_error("crc32c", b"x", -1, exc=ValueError, match="value -1 is not a 32-bit CRC")
    check_error("crc32c", b"x", 2**32, exc=ValueError, match="value 4294967296 is not a 32-bit CRC")
    check_error("crc32c", b"x", 2**80, exc=ValueError, match="is not a 32-bit CRC")
    released = memoryview(b"abc")
    released.release()
    check_error("crc32c", released, exc=ValueError, match="released memoryview")


# --------------------------------------------------------------------------- gather_crc


def _gather_both(chunks: list[bytes], make_dest: Callable[[int], Any]) -> tuple[int, bytes]:
    """``gather_crc`` of ``chunks`` (each in a numpy array, by address) into a fresh ``make_dest(total)``
    on each core: the same CRC and the same bytes written, which are the chunks' in order."""
    arrays = [np.frombuffer(c, dtype=np.uint8).copy() for c in chunks]  # (kept alive through both calls)
    addresses = [a.ctypes.data if a.size else 0 for a in arrays]
    sizes = [a.size for a in arrays]
    total = sum(sizes)
    out = []
    for core in (P, C):
        dest = make_dest(total)
        crc = core.gather_crc(dest, list(addresses), list(sizes))
        out.append((crc, bytes(memoryview(dest).cast("B"))))
    assert out[0] == out[1]
    joined = b"".join(chunks)
    assert out[0][1] == joined and out[0][0] == _crc32c_reference(joined)
    return out[0]


def _dest_bytearray(n: int) -> Any:
    return bytearray(n)


def _dest_float_view(n: int) -> Any:  # a multi-byte format of the same bytes
    return memoryview(np.zeros(n // 4, np.float32)) if n % 4 == 0 else memoryview(bytearray(n))


def test_gather_crc_copies_in_order() -> None:
    """Chunks land in order, empty ones included; the CRC is the reference's of the whole buffer, from a
    bytearray and a memoryview; above 1 MiB (the C++ core without the GIL) and across its 32 KiB pieces."""
    rng = random.Random(5)
    assert _gather_both([], _dest_bytearray) == (0, b"")
    _gather_both([b"123456789"], _dest_bytearray)
    _gather_both([b"", b"abc", b"", b"defg"], _dest_float_view)
    _gather_both([rng.randbytes(n) for n in (1 << 20, 77, 32 << 10, (32 << 10) + 1, 5)], _dest_bytearray)
    _gather_both([rng.randbytes(3 << 20 | 13)], lambda n: memoryview(bytearray(n)))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.lists(st.binary(max_size=3000), max_size=12), st.booleans())
def test_gather_crc_agrees(chunks: list[bytes], as_view: bool) -> None:
    """Any chunks: both cores write the same bytes (the chunks') and give the reference CRC-32C."""
    _gather_both(chunks, (lambda n: memoryview(bytearray(n))) if as_view else _dest_bytearray)


def test_gather_crc_errors() -> None:
    """The same TypeError/ValueError and message from both cores for each refusal, before anything is copied."""
    ok = bytearray(4)
    check_error("gather_crc", "text", [], [], exc=TypeError, match="expected bytearray or memoryview, got str")
    check_error("gather_crc", b"abcd", [], [], exc=TypeError, match="got bytes")
    check_error("gather_crc", np.zeros(4, np.uint8), [], [], exc=TypeError, match="got ndarray")
    strided = memoryview(bytearray(16)).cast("B", (4, 4))[::2]
    check_error("gather_crc", strided, [], [], exc=ValueError, match="C-contiguous")
    check_error("gather_crc", memoryview(b"abcd"), [], [], exc=ValueError, match="expected a writable buffer")
    released = memoryview(bytearray(4))
    released.release()
    check_error("gather_crc", released, [], [], exc=ValueError, match="released memoryview")
    check_error("gather_crc", ok, (1,), [4], exc=TypeError, match="expected addresses as a list, got tuple")
    check_error("gather_crc", ok, [1], (4,), exc=TypeError, match="expected sizes as a list, got tuple")
    check_error("gather_crc", ok, [1, 2], [4], exc=ValueError, match="differ in length (2 and 1)")
    check_error("gather_crc", ok, [1.0], [4], exc=TypeError, match="expected addresses[0] as an int, got float")
    check_error("gather_crc", ok, [1], [True], exc=TypeError, match="expected sizes[0] as an int, got bool")
    check_error("gather_crc", ok, [1, -1], [2, 2], exc=ValueError, match="addresses[1] is negative: -1")
    check_error("gather_crc", ok, [2**64], [4], exc=ValueError, match="addresses[0] is too large: 18446744073709551616")
    check_error("gather_crc", ok, [1], [-4], exc=ValueError, match="sizes[0] is negative: -4")
    check_error("gather_crc", ok, [1], [2**62 + 1], exc=ValueError, match="sizes[0] is too large")
    check_error("gather_crc", ok, [1], [2**200], exc=ValueError, match="sizes[0] is too large")
    check_error("gather_crc", ok, [0, 0], [0, 4], exc=ValueError, match="addresses[1] is 0 for 4 bytes")
    check_error("gather_crc", ok, [1, 1], [2**62, 1], exc=ValueError, match="sizes add up to more than")
    check_error("gather_crc", ok, [1], [3], exc=ValueError, match="sizes add up to 3 bytes, the buffer has 4")
    check_error("gather_crc", ok, [2**64 - 1], [5], exc=ValueError, match="sizes add up to 5 bytes, the buffer has 4")
    assert ok == bytearray(4)


# --------------------------------------------------------------------------- gather_many


def _many_both(
    groups: list[list[bytes]], checksums: list[bool], claimed: list[bool] | None = None, from_end: bool = False
) -> list[int | None]:
    """``gather_many`` of one job per group of chunks (each chunk in a numpy array, by address) on each core,
    with ``claims`` preset from ``claimed`` where given: the same result and the same bytes written, which
    are each group's chunks in order where the job ran (its bytes unclaimed) and zeros elsewhere; a job
    that ran with a checksum gives the reference CRC-32C of its bytes, every other job ``None``."""
    arrays = [[np.frombuffer(c, dtype=np.uint8).copy() for c in chunks] for chunks in groups]
    out = []
    for core in (P, C):
        dests = [bytearray(sum(a.size for a in group)) for group in arrays]
        jobs = [
            (memoryview(d), [a.ctypes.data if a.size else 0 for a in group], [a.size for a in group], checksum)
            for d, group, checksum in zip(dests, arrays, checksums)
        ]
        claims = None if claimed is None else bytearray(map(int, claimed))
        result = core.gather_many(jobs, claims, from_end)
        if claims is not None:
            assert claims == bytearray([1] * len(jobs))  # (every job claimed: by this call or before it)
        out.append((result, [bytes(d) for d in dests]))
    assert out[0] == out[1]
    result, written = out[0]
    for j, (chunks, checksum) in enumerate(zip(groups, checksums)):
        ran = claimed is None or not claimed[j]
        joined = b"".join(chunks)
        assert written[j] == (joined if ran else bytes(len(joined)))
        assert result[j] == (_crc32c_reference(joined) if ran and checksum else None)
    return result


def test_gather_many_copies_each_job() -> None:
    """Each job lands in its own buffer, with its CRC-32C where asked; no jobs, empty jobs; above 1 MiB in
    all (the C++ core without the GIL)."""
    rng = random.Random(7)
    assert _many_both([], []) == []
    _many_both([[b"123456789"], [b"", b"abc"], []], [True, False, True])
    _many_both([[rng.randbytes(600 << 10)], [rng.randbytes(77), rng.randbytes(700 << 10)]], [False, True])


def test_gather_many_runs_only_what_it_claims() -> None:
    """With ``claims``, a call runs the jobs whose byte is 0 (setting it) and no other, in either order; a
    second call on the same claims runs nothing."""
    groups = [[b"ab"], [b"cde"], [b""], [b"fghi"]]
    _many_both(groups, [True, True, False, True], [False, True, False, True])
    _many_both(groups, [True, True, True, True], [False, False, False, False], from_end=True)
    assert _many_both(groups, [True, False, True, True], [True] * 4) == [None] * 4


def _from_both_ends(core: Any, jobs: list, claims: bytearray) -> dict[bool, list[int | None]]:
    """``core.gather_many(jobs, claims, from_end)`` on two threads at once, one from each end."""
    import threading

    results: dict[bool, list[int | None]] = {}
    start = threading.Barrier(2)

    def run(from_end: bool) -> None:
        start.wait()
        results[from_end] = core.gather_many(jobs, claims, from_end)

    threads = [threading.Thread(target=run, args=(end,)) for end in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_gather_many_shares_its_jobs_between_threads() -> None:
    """Two calls on two threads over the same jobs and claims, one from each end: every job runs exactly
    once (its CRC-32C in exactly one of the two results), and every buffer holds its bytes."""
    rng = random.Random(11)
    chunks = [rng.randbytes(rng.randrange(1, 300 << 10)) for _ in range(40)]
    arrays = [np.frombuffer(c, dtype=np.uint8).copy() for c in chunks]
    for core in (P, C):
        dests = [bytearray(a.size) for a in arrays]
        jobs = [(memoryview(d), [a.ctypes.data], [a.size], True) for d, a in zip(dests, arrays)]
        results = _from_both_ends(core, jobs, bytearray(len(jobs)))
        assert [bytes(d) for d in dests] == chunks
        for j, c in enumerate(chunks):
            assert [r[j] for r in results.values() if r[j] is not None] == [_crc32c_reference(c)], (core, j)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    st.lists(st.tuples(st.lists(st.binary(max_size=2000), max_size=5), st.booleans(), st.booleans()), max_size=8),
    st.booleans(),
    st.booleans(),
)
def test_gather_many_agrees(jobs: list[tuple[list[bytes], bool, bool]], with_claims: bool, from_end: bool) -> None:
    """Any jobs, claims and order: both cores write the same bytes and give the same results."""
    claimed = [c for _chunks, _checksum, c in jobs] if with_claims else None
    _many_both([chunks for chunks, _c, _d in jobs], [checksum for _c, checksum, _d in jobs], claimed, from_end)


def test_gather_many_errors() -> None:
    """The same TypeError/ValueError and message from both cores for each refusal, before anything is
    copied: the jobs list, each job's shape and checksum flag, `gather_crc`'s checks after ``jobs[j]: ``,
    then ``claims`` and ``from_end``."""
    src = np.frombuffer(b"abcd", dtype=np.uint8).copy()
    ok = bytearray(4)
    job = (ok, [src.ctypes.data], [4], True)
    check_error("gather_many", (job,), exc=TypeError, match="expected jobs as a list, got tuple")
    check_error("gather_many", [job, [ok]], exc=TypeError, match="jobs[1]: expected a tuple, got list")
    check_error(
        "gather_many",
        [(ok, [], [])],
        exc=ValueError,
        match="jobs[0]: expected (dest, addresses, sizes, checksum), got 3",
    )
    check_error("gather_many", [(ok, [], [], 1)], exc=TypeError, match="jobs[0]: expected checksum as a bool, got int")
    check_error(
        "gather_many",
        [job, (b"ab", [], [], True)],
        exc=TypeError,
        match="jobs[1]: expected bytearray or memoryview, got bytes",
    )
    check_error(
        "gather_many", [(memoryview(b"ab"), [], [], False)], exc=ValueError, match="jobs[0]: expected a writable buffer"
    )
    check_error(
        "gather_many", [(ok, (1,), [4], True)], exc=TypeError, match="jobs[0]: expected addresses as a list, got tuple"
    )
    check_error(
        "gather_many",
        [(ok, [1, 2], [4], True)],
        exc=ValueError,
        match="jobs[0]: addresses and sizes differ in length (2 and 1)",
    )
    check_error(
        "gather_many",
        [(ok, [1.0], [4], True)],
        exc=TypeError,
        match="jobs[0]: expected addresses[0] as an int, got float",
    )
    check_error("gather_many", [(ok, [-1], [4], True)], exc=ValueError, match="jobs[0]: addresses[0] is negative: -1")
    check_error("gather_many", [(ok, [1], [2**62 + 1], True)], exc=ValueError, match="jobs[0]: sizes[0] is too large")
    check_error("gather_many", [(ok, [0], [4], True)], exc=ValueError, match="jobs[0]: addresses[0] is 0 for 4 bytes")
    check_error(
        "gather_many", [(ok, [1, 1], [2**62, 1], True)], exc=ValueError, match="jobs[0]: sizes add up to more than"
    )
    check_error(
        "gather_many",
        [job, (ok, [1], [3], True)],
        exc=ValueError,
        match="jobs[1]: sizes add up to 3 bytes, the buffer has 4",
    )
    check_error("gather_many", [job], b"\0", exc=TypeError, match="expected claims as a bytearray or None, got bytes")
    check_error("gather_many", [job], bytearray(2), exc=ValueError, match="claims has 2 bytes for 1 jobs")
    check_error("gather_many", [job], None, 1, exc=TypeError, match="expected from_end as a bool, got int")
    check_error("gather_many", [job, (ok, [1], [3], True)], bytearray(3), exc=ValueError, match="jobs[1]: sizes add up")
    assert ok == bytearray(4)


# --------------------------------------------------------------------------- bucketed layout: collect_plain


class _FakeDTensor:
    """A stand-in ``dtensor_type``: a parameter of this type goes to the ``sharded`` callback."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = torch.Size(shape)


_COLLECT_SHAPES = ((2, 3), (3,), (), (4, 4), (0, 2))
_COLLECT_DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64)
_COLLECT_KEYS = ("exp_avg", "exp_avg_sq", "step", "a.b", "~x", "", "é", 1, -2, True, None, 1.5, (1,))
_VALUE_KINDS = (
    *("same", "same", "same", "other_shape", "scalar", "meta", "sparse", "parameter", "number", "none"),
    *("transposed", "neg", "conj", "strided"),
)


def _state_value(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> Any:
    """A state value of ``kind`` for a parameter of ``shape``; only ``same`` can be taken."""
    if kind == "same":
        return torch.full(shape, float(seed)).to(dtype)
    if kind == "other_shape":
        return torch.zeros((*shape, 1), dtype=dtype)
    if kind == "scalar":
        return torch.tensor(seed, dtype=dtype)
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "sparse":
        return torch.zeros(shape, dtype=dtype).to_sparse()
    if kind == "parameter":  # a tensor subclass: not exactly tensor_type
        return torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    # taken too, with no plain address: not contiguous (a square one keeps its shape), a neg bit, a conj bit
    if kind == "transposed":
        return torch.full(shape, float(seed)).to(dtype).transpose(0, -1) if len(shape) > 1 else torch.zeros(shape)
    if kind == "strided":
        return torch.zeros((*shape, 2), dtype=dtype)[..., 0]
    if kind == "neg":  # (a real tensor with the neg bit: the imaginary part of a conjugate view)
        return torch.full(shape, complex(0, seed)).conj().imag
    if kind == "conj":
        return torch.full(shape, complex(seed, 1)).conj()
    return {"number": 1.5, "none": None}[kind]


_collect_states = st.one_of(
    st.sampled_from(["list", "int", "ordered"]),  # not exactly a dict: skipped
    st.dictionaries(
        st.sampled_from(_COLLECT_KEYS),
        st.tuples(st.sampled_from(_VALUE_KINDS), st.integers(0, len(_COLLECT_DTYPES) - 1), st.booleans()),
        max_size=5,
    ),
)
_collect_specs = st.tuples(
    st.dictionaries(
        st.sampled_from(["w", "b.c", "é", "x~y", 3]),
        st.tuples(
            st.sampled_from(["plain", "plain", "plain", "missing", "none", "dtensor"]),
            st.integers(0, len(_COLLECT_SHAPES) - 1),
            _collect_states,
        ),
        max_size=5,
    ),
    st.sampled_from([None, 0, 1, 8, 24, 48, 10**6]),
)


def _collect_inputs(
    spec: tuple[dict, Any], raise_in: str | None = None, raise_at: int = 0, with_addresses: bool = True
) -> tuple[tuple, dict]:
    """Fresh ``collect_plain`` arguments for ``spec`` (the real callbacks of sparse_ckpt._layouts.bucketed,
    wrapped to log their calls) and what the checks read after the call: ``items``, the log, the caches,
    the ``addresses`` list (``None`` without ``with_addresses``). ``raise_in``: that callback raises on its
    ``raise_at``-th call."""
    params, own = spec
    log: list[tuple[Any, ...]] = []
    names, geometry = _Names(own), _Geometry()
    state_fqn: dict[Any, Any] = {}
    param_of: dict[Any, Any] = {}
    items: dict[str, Any] = {"state.zz.first": 0}
    for i, (fqn, (kind, shape_index, state_spec)) in enumerate(params.items()):
        shape = _COLLECT_SHAPES[shape_index]
        if kind == "plain":
            param_of[fqn] = torch.nn.Parameter(torch.zeros(shape))
        elif kind == "none":
            param_of[fqn] = None
        elif kind == "dtensor":
            param_of[fqn] = _FakeDTensor(shape)
        if isinstance(state_spec, str):
            state_fqn[fqn] = {"list": [], "int": 5, "ordered": collections.OrderedDict(a=torch.zeros(shape))}[
                state_spec
            ]
            continue
        state = state_fqn[fqn] = {}
        for j, (key, (value_kind, dtype_index, has_item)) in enumerate(state_spec.items()):
            state[key] = _state_value(value_kind, shape, _COLLECT_DTYPES[dtype_index], 10 * i + j)
            part = _Names(None).part(key)
            if has_item and part is not None:
                items[f"state.{fqn}.{part}"] = ("item", fqn, part)
    items["state.zz.last"] = 1

    def logged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            log.append((name, *args) if name != "sharded" else (name, args[0], args[1].shape, *map(len, args[3:])))
            if name == raise_in and sum(entry[0] == name for entry in log) > raise_at:
                raise ValueError(f"{name} failed")
            return fn(*args)

        return call

    addresses: list[int | None] | None = [] if with_addresses else None

    def sharded(fqn: Any, p: Any, state: dict, entries: list, local: list) -> None:
        entries.append(("sharded", fqn))
        local.append(p.shape)
        if addresses is not None:
            addresses.append(-1)

    args = (
        state_fqn,
        items,
        param_of,
        torch.Tensor,
        _FakeDTensor,
        torch.strided,
        names.parts,
        logged("part_of", names.part),
        geometry.wholes,
        logged("whole", geometry.whole),
        logged("spec_of", names.spec),
        logged("sharded", sharded),
        addresses,
    )
    after = {"items": items, "log": log, "parts": names.parts, "specs": names.specs, "wholes": geometry.wholes}
    return args, {**after, "addresses": addresses}


def _check_collect(
    spec: tuple[dict, Any], raise_in: str | None = None, raise_at: int = 0, with_addresses: bool = True
) -> tuple:
    """``collect_plain`` on both cores, each with fresh equal inputs: the same outcome, the same
    ``items`` afterwards (the same deletions), the same callback calls in the same order, and every
    entry made of the callers' objects (the chunk tuples of ``wholes``, the names of ``spec_of``)
    and every local the state tensor itself, at its plain address (the same tensors: the same
    addresses, compared as the rest of what is left after the call). Returns the Python outcome."""
    runs = []
    for core in (P, C):
        args, after = _collect_inputs(spec, raise_in, raise_at, with_addresses)
        result = outcome(core.collect_plain, args)
        runs.append((result, after))
        if result[0] != "ok":
            continue
        entries, local = result[1]
        state_fqn, param_of = args[0], args[2]
        for entry, value in zip(entries, local):
            if entry[0] == "sharded":
                continue
            chunk = after["wholes"][param_of[entry[0]].shape][0]
            assert all(a is b for a, b in zip(entry[4:], chunk)), entry
            assert entry[2] is after["specs"][value.dtype][0]
            assert any(value is v for v in state_fqn[entry[0]].values())
        if after["addresses"] is not None:  # (each run's own tensors: compared as which are plain)
            assert len(after["addresses"]) == len(local)
            for value, address in zip(local, after["addresses"]):
                if isinstance(value, torch.Tensor):
                    plain = value.is_contiguous() and not value.is_conj() and not value.is_neg()
                    assert address == (value.data_ptr() if plain else None), (value, address)
            after["addresses"] = [address is None for address in after["addresses"]]
    (py, py_after), (cc, cc_after) = runs
    if py[0] == "ok" and cc[0] == "ok":
        assert same(py[1], cc[1]), f"results differ\npython: {py[1]!r}\ncpp:    {cc[1]!r}"
    else:
        assert py[0] == cc[0] and py[1] is cc[1] and py[2:] == cc[2:], f"outcomes differ\npython: {py!r}\ncpp: {cc!r}"
    assert same(py_after, cc_after), f"after the call\npython: {py_after!r}\ncpp:    {cc_after!r}"
    return py


@PROPS
@given(_collect_specs, st.booleans())
def test_collect_plain(spec: tuple[dict, Any], with_addresses: bool) -> None:
    """Random leaves (shapes, dtypes, 0-d, meta and sparse tensors, a tensor subclass, non-tensors,
    odd keys, missing items and parameters, non-dict states, own-item limits, a DTensor-typed
    parameter, tensors that are not contiguous or carry a neg or conj bit): both cores take the same
    tensors out of ``items``, calling back alike, with the same addresses where they are asked for."""
    result = _check_collect(spec, with_addresses=with_addresses)
    assert result[0] == "ok", result


@PROPS
@given(_collect_specs, st.sampled_from(["part_of", "whole", "spec_of", "sharded"]), st.integers(0, 2))
def test_collect_plain_callback_errors(spec: tuple[dict, Any], raise_in: str, raise_at: int) -> None:
    """A callback's exception propagates from both cores, after the same deletions from ``items``."""
    _check_collect(spec, raise_in, raise_at)


def test_collect_plain_edge_cases() -> None:
    adam = {"step": ("scalar", 0, True), "exp_avg": ("same", 0, True), "exp_avg_sq": ("same", 1, True)}
    # everything taken (no limit); a limit of 0 elements keeps every tensor an item of its own
    taken = _check_collect(({"w": ("plain", 0, adam), "v": ("plain", 3, adam)}, None))
    assert [(e[0], e[1], e[2]) for e in taken[1][0]] == [
        ("w", "exp_avg", "float32"),
        ("w", "exp_avg_sq", "bfloat16"),
        ("v", "exp_avg", "float32"),
        ("v", "exp_avg_sq", "bfloat16"),
    ]
    assert _check_collect(({"w": ("plain", 0, adam)}, 0))[1] == ([], [])
    # 24 bytes: a float32 (2, 3) state (6 elements, limit 6) stays, a bfloat16 one (limit 12) goes
    assert [e[1] for e in _check_collect(({"w": ("plain", 0, adam)}, 24))[1][0]] == ["exp_avg_sq"]
    # a DTensor-typed parameter goes to ``sharded`` with the lists the entries go to
    both = _check_collect(({"d": ("dtensor", 1, adam), "w": ("plain", 1, adam)}, None))
    assert both[1][0][0] == ("sharded", "d") and both[1][1][0] == torch.Size((3,))
    # odd keys: an escaped str part, an int part, a key without a part
    odd = {"a.b": ("same", 2, True), 7: ("same", 2, True), None: ("same", 2, True), (1,): ("same", 0, True)}
    parts = [e[1] for e in _check_collect(({"w": ("plain", 1, odd)}, None))[1][0]]
    assert parts == [_Names(None).part("a.b"), _Names(None).part(7)]
    # plain addresses: a contiguous tensor's data_ptr, None for one not contiguous or with a neg/conj bit
    kinds = ("same", "transposed", "strided", "neg", "conj")
    bits = {f"k{i}": (kind, 0, True) for i, kind in enumerate(kinds)}
    for core in (P, C):
        args, after = _collect_inputs(({"w": ("plain", 3, bits)}, None))
        _entries, local = core.collect_plain(*args)
        assert [e is None for e in after["addresses"]] == [False, True, True, True, True]
        assert after["addresses"][0] == local[0].data_ptr()


def test_collect_plain_outside_contract() -> None:
    """An ``items`` or ``parts`` that is no dict: the C++ core says what it expected."""
    state_spec = {"exp_avg": ("same", 0, True)}
    args, _after = _collect_inputs(({"w": ("plain", 0, state_spec)}, None))
    outside_contract("collect_plain", *(args[:1] + (list(args[1]),) + args[2:]))
    outside_contract("collect_plain", *(args[:6] + ([],) + args[7:]))
    outside_contract("collect_plain", *(args[:12] + ((),)))
