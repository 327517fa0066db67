"""``bucketed.fill``/``stack_into``: a bucket holds its chunks' values in order, element for element
what ``torch.cat`` of the flattened chunks gives, whatever their shapes, strides or autograd flags."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ckpt._layouts.bucketed import fill, stack_into

SHAPES = [(3,), (2, 3), (3, 2), (0, 4), (4, 4), (1, 1, 2)]


def _chunk(shape: tuple[int, ...], how: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if how == "transposed" and len(shape) == 2:
        return torch.randn(shape[::-1], generator=g).t()  # non-contiguous
    if how == "grad":
        return torch.randn(shape, generator=g).requires_grad_()
    if how == "strided" and len(shape) == 1:
        return torch.randn(shape[0] * 2, generator=g)[::2]
    return torch.randn(shape, generator=g)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(SHAPES), st.sampled_from(["plain", "transposed", "grad", "strided"])),
        min_size=1,
        max_size=12,
    )
)
def test_stack_into_is_cat_of_flattened(spec: list[tuple[tuple[int, ...], str]]) -> None:
    chunks = [_chunk(shape, how, i) for i, (shape, how) in enumerate(spec)]
    expected = torch.cat([c.detach().reshape(-1) for c in chunks])
    buf = torch.full((expected.numel(),), float("nan"))
    stack_into(buf, chunks)
    assert torch.equal(buf, expected)
    given_shapes = torch.full((expected.numel(),), float("nan"))  # the shapes as the layout entries give them
    stack_into(given_shapes, chunks, [shape for shape, _how in spec])
    assert torch.equal(given_shapes, expected)
    assert not any(c.grad is not None for c in chunks) and torch.is_grad_enabled()


def test_fill_runs_of_shapes_and_a_lone_chunk() -> None:
    chunks = [
        torch.arange(6.0).view(2, 3),
        torch.arange(6.0, 12.0).view(2, 3),
        torch.arange(12.0, 15.0),
        torch.arange(15.0, 21.0).view(3, 2),
    ]
    lone = torch.arange(4.0).view(2, 2)
    buckets = [("float32", 21, [(i, 0) for i in range(4)]), ("float32", 4, [(4, 0)])]
    big, alone = fill(buckets, [*chunks, lone])
    assert torch.equal(big, torch.arange(21.0))
    sized, _alone = fill(buckets, [*chunks, lone], sizes=[(2, 3), (2, 3), (3,), (3, 2), (2, 2)])
    assert torch.equal(sized, torch.arange(21.0))
    assert alone.data_ptr() == lone.data_ptr()  # one chunk alone: the live tensor, flattened, no copy
    assert torch.equal(alone, torch.arange(4.0))
