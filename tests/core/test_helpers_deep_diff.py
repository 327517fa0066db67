"""`tests.helpers.deep_diff`, split into one step per kind of value (tensor, mapping, sequence,
anything else), finds the same first difference, in the same words, as the single function it
replaced. The replaced function is kept here, unchanged but for recursing into itself, as the
reference; the inputs are random nested values and near-copies of them, under every option."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from helpers import NanEqual, _both_nan_equal, deep_diff
from hypothesis import given, settings
from hypothesis import strategies as st


def reference_deep_diff(  # noqa: C901 -- the replaced implementation, kept whole as the reference
    a: Any,
    b: Any,
    where: str = "value",
    *,
    check_order: bool = True,
    nan_equal: NanEqual = "all",
    mapping: type = Mapping,
) -> str | None:
    """The first difference between ``a`` and ``b`` as a message, or ``None`` when they are equal.

    Recursive exact comparison:

    * tensors: both tensors, same dtype, shape and device, ``torch.equal`` values;
    * mappings (instances of ``mapping``): same keys -- in the same order unless
      ``check_order=False`` -- and equal values.  ``mapping=dict`` is the stricter
      ``isinstance(x, dict)`` test: the other side must be a dict too, and a non-dict mapping is
      compared as a plain value;
    * lists and tuples: same type and length, equal items;
    * anything else: same type and ``==``.

    ``nan_equal`` says where NaN equals NaN: ``"all"`` (Python floats, and floating tensors with
    NaNs in the same places), ``"floats"`` (Python floats only; tensors follow ``torch.equal``),
    ``"none"`` (nowhere: plain ``==`` and ``torch.equal``).
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a)} vs {type(b)}"
        if a.dtype != b.dtype:
            return f"{where}: dtype {a.dtype} vs {b.dtype}"
        if a.shape != b.shape:
            return f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.device != b.device:
            return f"{where}: device {a.device} vs {b.device}"
        if not (torch.equal(a, b) or (nan_equal == "all" and _both_nan_equal(a, b))):
            return f"{where}: tensors differ\n{a}\n{b}"
        return None
    options: dict[str, Any] = {"check_order": check_order, "nan_equal": nan_equal, "mapping": mapping}
    if isinstance(a, mapping):
        if not isinstance(b, mapping):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if check_order:
            if list(a.keys()) != list(b.keys()):
                return f"{where}: keys {list(a.keys())} vs {list(b.keys())}"
        elif set(a.keys()) != set(b.keys()):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            diff = reference_deep_diff(a[k], b[k], f"{where}[{k!r}]", **options)
            if diff is not None:
                return diff
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = reference_deep_diff(x, y, f"{where}[{i}]", **options)
            if diff is not None:
                return diff
        return None
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"
    if nan_equal != "none" and isinstance(a, float) and math.isnan(a):
        return None if math.isnan(b) else f"{where}: nan vs {b!r}"
    if a == b:  # ``==`` (not ``!=``), exactly as an ``assert a == b``
        return None
    return f"{where}: {a!r} vs {b!r}"


_TENSORS = st.sampled_from(
    [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([1.0, 2.0]),
        torch.tensor([1.0, 2.0], dtype=torch.float64),
        torch.tensor([[1.0, 2.0]]),
        torch.tensor([1, 2]),
        torch.tensor(float("nan")),
        torch.zeros(0),
    ]
)
_LEAVES = st.one_of(
    st.integers(-2, 2),
    st.booleans(),
    st.sampled_from([0.0, 1.5, float("nan"), -0.0, "a", "b", None]),
    _TENSORS,
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.sampled_from(["x", "y", 1, "z"])
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(OrderedDict),
    )


_VALUES = st.recursive(_LEAVES, _containers, max_leaves=8)


def _copy_of(value: Any) -> Any:
    """A structural copy (new containers, the same leaves): equal, whatever deep_diff's options."""
    if isinstance(value, OrderedDict):
        return OrderedDict((k, _copy_of(v)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _copy_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_of(v) for v in value)
    return value.clone() if isinstance(value, torch.Tensor) else value


@st.composite
def _near(draw: Any, value: Any) -> Any:
    """``value`` with at most one change somewhere: a leaf replaced, keys reordered, a container's type."""
    if isinstance(value, Mapping) and value and draw(st.booleans()):
        k = draw(st.sampled_from(list(value)))
        how = draw(st.sampled_from(["child", "reorder", "drop", "retype"]))
        items = [(key, draw(_near(v)) if key == k and how == "child" else v) for key, v in value.items()]
        if how == "reorder":
            items.reverse()
        if how == "drop":
            items = [(key, v) for key, v in items if key != k]
        kind = dict if how == "retype" and isinstance(value, OrderedDict) else type(value)
        return kind(items) if kind is not OrderedDict else OrderedDict(items)
    if isinstance(value, (list, tuple)) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        items = [draw(_near(v)) if j == i else v for j, v in enumerate(value)]
        how = draw(st.sampled_from(["same", "shorter", "retype"]))
        if how == "shorter":
            items = items[:-1]
        kind = (tuple if isinstance(value, list) else list) if how == "retype" else type(value)
        return kind(items)
    return draw(st.one_of(st.just(_copy_of(value)), _LEAVES))


@settings(max_examples=600, deadline=None)
@given(
    data=st.data(),
    a=_VALUES,
    check_order=st.booleans(),
    nan_equal=st.sampled_from(["all", "floats", "none"]),
    mapping=st.sampled_from([Mapping, dict]),
)
def test_deep_diff_finds_what_the_replaced_function_found(
    data: st.DataObject, a: Any, check_order: bool, nan_equal: NanEqual, mapping: type
) -> None:
    b = data.draw(st.one_of(_near(a), _VALUES))
    for x, y in ((a, b), (b, a), (a, _copy_of(a))):
        options = {"check_order": check_order, "nan_equal": nan_equal, "mapping": mapping}
        assert deep_diff(x, y, "v", **options) == reference_deep_diff(x, y, "v", **options)


def test_the_comparison_reaches_every_kind_of_difference() -> None:
    """Hand-made pairs for each message of the reference: equal ones and each kind of difference."""
    t = torch.tensor([1.0, float("nan")])
    pairs = [
        (t, t.clone()),
        (t, [1.0]),
        (t, t.double()),
        (t, t[None]),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({"a": 1}, {"a": 2}),
        ({"a": 1}, [1]),
        (OrderedDict(a=1), {"a": 1}),
        ([1, 2], (1, 2)),
        ([1, 2], [1]),
        ([1, [2, float("nan")]], [1, [2, float("nan")]]),
        (float("nan"), 1.0),
        (1, True),
        ("a", "b"),
    ]
    seen = set()
    for a, b in pairs:
        for nan_equal in ("all", "floats", "none"):
            for check_order in (True, False):
                for mapping in (Mapping, dict):
                    options = {"check_order": check_order, "nan_equal": nan_equal, "mapping": mapping}
                    expected = reference_deep_diff(a, b, "v", **options)
                    assert deep_diff(a, b, "v", **options) == expected
                    seen.add(expected.split(":")[1].split()[0] if expected else None)
    assert len(seen) >= 8, seen
