"""``bucketed.collect`` on plain parameters: which state tensors it buffers, with which layout
entries, and which per-item entries it takes, checked against the rule it implements, whatever
the keys (plain, escaped, ints, bools), dtypes (mixed within and across parameters), shapes (0-d
too), layouts, meta tensors, missing items and ``own_item_bytes`` thresholds."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ckpt._format.keys import STATE_PREFIX, escape_part, is_plain_part
from sparse_ckpt._layouts.bucketed import collect, dtype_name

SHAPES = [(), (3,), (2, 3), (3, 2), (1, 4)]
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.complex64]
KEYS: list[Any] = ["exp_avg", "exp_avg_sq", "m.x", "~y", 3, True, -1, 2.5]
KINDS = ["same", "same", "same", "other shape", "meta", "sparse", "not a tensor", "no item"]


def _value(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    if kind == "other shape":
        return torch.zeros((*shape, 2), dtype=dtype)
    if kind == "meta":
        return torch.zeros(shape, dtype=dtype, device="meta")
    if kind == "sparse" and len(shape) == 2 and dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype).to_sparse()
    if kind == "not a tensor":
        return 1.0
    return torch.zeros(shape, dtype=dtype)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(SHAPES),
            st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(DTYPES), st.sampled_from(KINDS)), max_size=4),
        ),
        max_size=8,
    ),
    st.sampled_from([None, 1, 8, 20, 10**9]),
)
def test_collect_takes_exactly_the_parameter_shaped_state(params: list, own_item_bytes: int | None) -> None:
    param_of: dict[str, torch.Tensor] = {}
    state_fqn: dict[str, Any] = {}
    items: dict[str, Any] = {}
    for n, (shape, state) in enumerate(params):
        fqn = f"layers.{n}.w"
        param_of[fqn] = torch.nn.Parameter(torch.zeros(shape))
        state_fqn[fqn] = {}
        for key, dtype, kind in state:
            v = state_fqn[fqn][key] = _value(kind, shape, dtype)
            part = key if is_plain_part(key) else escape_part(key)
            if part is not None and kind != "no item":
                items[f"{STATE_PREFIX}{fqn}.{part}"] = v
    state_fqn["not.a.param"] = {"exp_avg": torch.zeros(2)}
    items["other"] = torch.zeros(1)
    want, want_local, left = [], [], dict(items)
    for fqn, state in state_fqn.items():
        p = param_of.get(fqn)
        for key, v in state.items():
            if p is None or type(v) is not torch.Tensor or v.shape != p.shape or v.layout != torch.strided or v.is_meta:
                continue
            if own_item_bytes is not None and p.numel() * v.element_size() >= own_item_bytes:
                continue
            part = key if is_plain_part(key) else escape_part(key)
            if part is None or left.pop(f"{STATE_PREFIX}{fqn}.{part}", None) is None:
                continue
            shape = tuple(p.shape)
            want.append((fqn, part, dtype_name(v.dtype), v.element_size(), shape, (0,) * len(shape), shape))
            want_local.append(v)
    entries, local = collect("leaf", state_fqn, items, param_of, own_item_bytes)
    assert entries == want
    assert len(local) == len(want_local) and all(a is b for a, b in zip(local, want_local))
    assert items == left and list(items) == list(left)
