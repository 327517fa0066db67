"""Differential tests of the load-plan and save-ownership core functions (``csrc/load_assembly.cpp``,
``csrc/save_pass.cpp``) against their Python twins: same results, same callback calls in the
same order, same exceptions and messages. Random inputs (hypothesis, derandomized) plus edge cases.
"""

from __future__ import annotations

import collections
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import _backends
import torch
from helpers import same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_ckpt import _core_py as P
from sparse_ckpt._load.apply import cast_tensor, cast_value, copy_settings
from sparse_ckpt._load.load import _check_state_shapes
from sparse_ckpt.errors import CheckpointFormatError, CheckpointMismatchError

C = _backends.cpp_core()  # (skips the module where _C is not built, unless SPARSE_CKPT_REQUIRE_CPP)

PROPS = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


core_backend = _backends.both_cores_directly


def outcome(fn: Callable[[], Any]) -> tuple:
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the exception is what we compare
        return ("err", type(exc), str(exc))


def both(run: Callable[[Any], Any]) -> tuple:
    """``run(core)`` on both cores; assert equal outcomes; return the Python one."""
    py, cc = outcome(lambda: run(P)), outcome(lambda: run(C))
    if py[0] == cc[0] == "ok":
        assert same_bits(py[1], cc[1]), f"results differ\npython: {py[1]!r}\ncpp:    {cc[1]!r}"
    else:
        assert py == cc, f"outcomes differ\npython: {py!r}\ncpp:    {cc!r}"
    return py


# --------------------------------------------------------------------------- fqns_of_groups


@PROPS
@given(st.lists(st.lists(st.integers(0, 5), max_size=4), max_size=4), st.sets(st.integers(0, 5)))
def test_fqns_of_groups(layout: list[list[int]], unowned: set[int]) -> None:
    params = [torch.nn.Parameter(torch.zeros(i + 1)) for i in range(6)]
    groups = [{"params": [params[i] for i in g], "lr": 0.1} for g in layout]
    fqn_of = {id(p): f"m.w{i}" for i, p in enumerate(params) if i not in unowned}
    result = both(lambda core: core.fqns_of_groups("leaf", groups, fqn_of))
    if result[0] == "err":
        assert result[1] is CheckpointMismatchError and "is not owned by the model" in result[2]


# --------------------------------------------------------------------------- build_groups

SETTINGS = [
    {"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "name": "x", "b": b"y", "flag": True},
    {"lr": 0.2, "milestones": [1, 2], "nested": {"a": [1]}},
    {"lr": torch.tensor(0.3), "betas": (0.9, [0.99])},
    {"param_names": ["saved.w"], "lr": 0.4},
]


@PROPS
@given(
    st.lists(st.tuples(st.sampled_from([None, 0, 1, 2, 3]), st.booleans()), max_size=6),
    st.booleans(),
)
def test_build_groups(spec: list[tuple[int | None, bool]], keep_names: bool) -> None:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in spec]
    groups = []
    for i, (_choice, named) in enumerate(spec):
        g: dict[str, Any] = {"params": [params[i]], "lr": 0.01, "momentum": [0.5]}
        if named:
            g["param_names"] = [f"own.{i}"]
        groups.append(g)
    chosen = [None if c is None else SETTINGS[c] for c, _n in spec]
    result = both(lambda core: core.build_groups(groups, chosen, copy_settings, keep_names))
    built = result[1]
    for g, new, c in zip(groups, built, chosen):
        assert new["params"] is g["params"]
        source = c if c is not None else g
        for key, value in source.items():
            if key != "params" and isinstance(value, (list, dict)):
                assert new[key] is not value  # copied, never shared


# --------------------------------------------------------------------------- cast_states

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


@st.composite
def cast_inputs(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 5))
    params = [
        torch.nn.Parameter(torch.zeros(2, dtype=d), requires_grad=d.is_floating_point)
        for d in [draw(st.sampled_from(DTYPES[:3])) for _ in range(n)]
    ]
    layout = draw(st.lists(st.lists(st.integers(0, n - 1), max_size=3), min_size=1, max_size=3))
    flags = draw(
        st.lists(
            st.sampled_from([{}, {"fused": True}, {"capturable": True}, {"fused": None}]),
            min_size=len(layout),
            max_size=len(layout),
        )
    )
    state_of: dict[str, Any] = {}
    for i in range(n):
        kind = draw(st.sampled_from(["none", "adam", "mixed", "nested", "scalar", "badshape"]))
        if kind == "adam":
            state_of[f"w{i}"] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, dtype=params[i].dtype)}
        elif kind == "mixed":
            state_of[f"w{i}"] = {
                "step": torch.tensor(1.0, dtype=torch.float64),
                "m": torch.ones(2, dtype=torch.float64),
                "count": 7,
                "ints": torch.ones(2, dtype=torch.int64),
            }
        elif kind == "nested":
            state_of[f"w{i}"] = {"inner": {"step": torch.tensor(2.0), "v": torch.ones(2)}, "lst": [torch.ones(1)]}
        elif kind == "scalar":
            state_of[f"w{i}"] = [torch.ones(2)]
        elif kind == "badshape":
            state_of[f"w{i}"] = {"exp_avg": torch.ones(3)}
    return params, layout, flags, state_of


@PROPS
@given(cast_inputs(), st.booleans())
def test_cast_states(inputs: tuple, with_check: bool) -> None:
    params, layout, flags, state_of = inputs
    groups = [{"params": [params[i] for i in g]} for g in layout]
    target = [[f"w{i}" for i in g] for g in layout]
    chosen = [f if i % 2 else None for i, f in enumerate(flags)]  # None: the group's own settings
    for g, f, c in zip(groups, flags, chosen):
        if c is None:
            g.update(f)

    def run(core: Any) -> tuple:
        calls: list[tuple] = []

        def check(leaf: str, fqn: str, p: Any, saved: Any) -> None:
            calls.append(("check", fqn))
            _check_state_shapes(leaf, fqn, p, saved)

        def ct(*args: Any) -> Any:
            calls.append(("tensor", args[1], args[2], args[3]))
            return cast_tensor(*args)

        def cv(*args: Any) -> Any:
            calls.append(("value", args[3], args[2]))
            return cast_value(*args)

        state: defaultdict = defaultdict(dict)
        used = core.cast_states(
            "leaf", groups, target, chosen, state_of, state, torch.Tensor, check if with_check else None, ct, cv
        )
        keyed = [(params.index(p), v) for p, v in state.items()]
        return used, keyed, calls

    result = both(run)
    if result[0] == "ok":
        _used, keyed, _calls = result[1]
        for i, value in keyed:  # every tensor follows torch's cast policy
            if isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, torch.Tensor) and k != "step" and params[i].is_floating_point():
                        assert v.dtype == params[i].dtype


def test_cast_states_keeps_tensors_that_need_no_cast() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    saved = {"step": torch.tensor(1.0), "exp_avg": torch.ones(2), "half": torch.ones(2, dtype=torch.float16)}
    for core in (P, C):
        state: dict = {}
        core.cast_states(
            "l", [{"params": [p]}], [["w"]], [None], {"w": saved}, state, torch.Tensor, None, cast_tensor, cast_value
        )
        out = state[p]
        assert out["step"] is saved["step"] and out["exp_avg"] is saved["exp_avg"]
        assert out["half"].dtype == torch.float32
        fused: dict = {}
        step64 = {"step": torch.tensor(1.0, dtype=torch.float64)}
        core.cast_states(
            "l",
            [{"params": [p]}],
            [["w"]],
            [{"fused": True}],
            {"w": step64},
            fused,
            torch.Tensor,
            None,
            cast_tensor,
            cast_value,
        )
        assert fused[p]["step"].dtype == torch.float32  # fused/capturable: float32 on the param's device
        plain: dict = {}
        core.cast_states(
            "l",
            [{"params": [p]}],
            [["w"]],
            [{"lr": 0.1}],
            {"w": step64},
            plain,
            torch.Tensor,
            None,
            cast_tensor,
            cast_value,
        )
        assert plain[p]["step"] is step64["step"]  # otherwise step is left alone


# --------------------------------------------------------------------------- merge_table_settings


@PROPS
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.sampled_from(["a", "b", "c", "alias_a", "d"]), max_size=3)), max_size=5
    ),
    st.booleans(),
)
def test_merge_table_settings(groups: list[tuple[int, list[str]]], preset: bool) -> None:
    settings_list = [{"lr": 0.1}, {"lr": 0.2}, {"lr": 0.3}]
    canonical = {"a": "a", "alias_a": "a", "b": "b"}

    def run(core: Any) -> tuple:
        settings_of: dict = {"d": settings_list[0]} if preset else {}
        empty, clash = core.merge_table_settings("leaf", settings_list, groups, canonical, settings_of)
        return empty, clash, settings_of

    result = both(run)
    assert result[0] == "ok"
    empty, clash, settings_of = result[1]
    # the reference: the first FQN whose canonical name already has another settings object
    seen: dict = {"d": settings_list[0]} if preset else {}
    expected = None
    for gi, (idx, fqns) in enumerate(groups):
        for fqn in fqns:
            canon = canonical.get(fqn, fqn)
            if seen.setdefault(canon, settings_list[idx]) is not settings_list[idx]:
                expected = (canon, gi)
                break
        if expected:
            break
    assert clash == expected
    if expected is None:
        assert empty == [gi for gi, (_i, fqns) in enumerate(groups) if not fqns] and settings_of == seen


# --------------------------------------------------------------------------- claim_owners


@PROPS
@given(
    st.lists(st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=3), max_size=4),
    st.dictionaries(st.sampled_from(["a", "b", "x"]), st.sampled_from(["leaf", "other"]), max_size=2),
)
def test_claim_owners(fqn_groups: list[list[str]], before: dict[str, str]) -> None:
    groups_fqn = [({"lr": 0.1}, fqns) for fqns in fqn_groups]

    def run(core: Any) -> tuple:
        owner = dict(before)
        return core.claim_owners("leaf", groups_fqn, owner), owner

    result = both(run)
    if result[0] == "err":
        assert result[1] is CheckpointMismatchError and "is in both leaf 'other' and leaf 'leaf'" in result[2]


# --------------------------------------------------------------------------- capture_fqns


@PROPS
@given(
    st.lists(st.lists(st.integers(0, 4), max_size=4), max_size=4),
    st.lists(st.integers(0, 5), max_size=5),
    st.sets(st.integers(0, 4), max_size=2),
    st.booleans(),
)
def test_capture_fqns(layout: list[list[int]], with_state: list[int], unowned: set[int], odd_key: bool) -> None:
    """Both cores agree, and on inputs the composition accepts, the one pass equals
    ``remap_to_fqns(pack_optimizer(...))`` (what the library did before the one pass)."""
    params = [torch.nn.Parameter(torch.zeros(i + 1)) for i in range(6)]  # params[5] is in no group
    groups = [{"params": [params[i] for i in g], "lr": 0.1, "betas": (0.9, 0.99)} for g in layout]
    state: dict[Any, Any] = {params[i]: {"step": torch.tensor(float(i))} for i in with_state}
    if odd_key:
        state["not a tensor"] = {}
    fqn_of = {id(p): f"m.w{i}" for i, p in enumerate(params) if i not in unowned}
    result = both(lambda core: core.capture_fqns("leaf", groups, state, fqn_of, torch.Tensor))
    reference = outcome(lambda: P.remap_to_fqns("leaf", *P.pack_optimizer("leaf", groups, state, torch.Tensor), fqn_of))
    if result[0] == "ok":
        assert reference[0] == "ok" and same_bits(result[1], reference[1])
    else:
        assert reference[0] == "err" and result[1] is reference[1]


def test_capture_fqns_shares_settings_of_identical_groups() -> None:
    """Groups whose keys and values are the same objects share one settings dict (torch shares a
    default among the groups that did not set it), in both cores; an equal value that is another
    object, or another key order, gets its own dict; the table is the same bytes either way."""
    from sparse_ckpt._format.tensor_parts import tensor_to_parts

    lr, betas = 0.1, (0.9, 0.99)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(5)]
    groups = [
        {"params": [params[0]], "lr": lr, "betas": betas},
        {"params": [params[1]], "lr": lr, "betas": betas},  # same objects: shared
        {"params": [params[2]], "lr": float("0.1"), "betas": betas},  # an equal lr, another object
        {"params": [params[3]], "betas": betas, "lr": lr},  # another key order
        {"lr": lr, "params": [params[4]], "betas": betas},  # "params" elsewhere: same settings objects
    ]
    fqn_of = {id(p): f"w{i}" for i, p in enumerate(params)}
    for core in (P, C):
        groups_fqn, _state = core.capture_fqns("leaf", groups, {}, fqn_of, torch.Tensor)
        settings = [s for s, _f in groups_fqn]
        assert settings[0] is settings[1] is settings[4]
        assert settings[2] is not settings[0] and settings[3] is not settings[0] and settings[2] == settings[0]
        unshared = [(dict(s), f) for s, f in groups_fqn]
        assert core.encode_table("leaf", groups_fqn, torch.Tensor, tensor_to_parts) == core.encode_table(
            "leaf", unshared, torch.Tensor, tensor_to_parts
        )


# --------------------------------------------------------------------------- merge_scalars


@PROPS
@given(
    st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([{}, {"exp_avg": 1}, {"step": 9}]), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "d", "e"]), st.sampled_from([0, 1, 2]), max_size=4),
)
def test_merge_scalars(state_spec: dict[str, dict], scalar_spec: dict[str, int | None]) -> None:
    """Same merged dicts, same order, same clash error; a shared scalar dict is handed out once,
    every later taker gets clones (tensors never shared between two FQNs)."""

    def fresh() -> tuple:
        shared = [{"step": torch.tensor(3.0), "n": 1}, {}, {"step": torch.tensor(1.0, dtype=torch.float64)}]
        state_of = {f: {k: torch.full((2,), float(v)) for k, v in s.items()} for f, s in state_spec.items()}
        scalars_of = {f: None if i is None else (shared[i], "leaf") for f, i in scalar_spec.items()}
        return state_of, scalars_of

    result = both(lambda core: core.merge_scalars(*fresh(), torch.Tensor))
    if result[0] == "err":
        assert result[1] is CheckpointFormatError and "both in a scalar table" in result[2]
        return
    merged = result[1]
    seen: set[int] = set()
    for state in merged.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                assert id(value) not in seen
                seen.add(id(value))


def test_merge_scalars_types() -> None:
    ok = ({"a": {}}, {"a": ({"step": 1}, "leaf")})
    for bad in (
        (collections.OrderedDict(ok[0]), ok[1]),
        (ok[0], collections.OrderedDict(ok[1])),
        (ok[0], {"a": [{"step": 1}, "leaf"]}),
        (ok[0], {"a": ({"step": 1},)}),
        ({"a": collections.OrderedDict()}, ok[1]),
        ({}, {"z": (collections.OrderedDict(step=1), "leaf")}),
    ):
        res = both(lambda core, bad=bad: core.merge_scalars(*bad, torch.Tensor))
        assert res[0] == "err" and res[1] is TypeError and "merge_scalars" in res[2]
    assert both(lambda core: core.merge_scalars(*ok, torch.Tensor))[1] == {"a": {"step": 1}}
