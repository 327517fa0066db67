"""``bucketed.fill``/``stack_into``: a bucket holds its chunks' values in order, element for element
what ``torch.cat`` of the flattened chunks gives, whatever their shapes, strides or autograd flags; the
parts handed to the capture's worker (``sparse_ckpt._save.worker``) and its CRCs and copies."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ckpt._format.bucket_checksums import tensor_crc
from sparse_ckpt._host_memory import HostPool
from sparse_ckpt._layouts import bucketed
from sparse_ckpt._layouts.bucketed import fill, stack_into
from sparse_ckpt._save.worker import CaptureWorker

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


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from(SHAPES), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=64),
)
def test_stack_into_hands_out_its_parts_in_order(shapes: list[tuple[int, ...]], segment: int) -> None:
    """With ``on_part``, the bucket is written in parts of about ``SEGMENT_BYTES`` (here a few bytes, so
    a run of one shape is split), each handed out once written: in order, together the whole bucket."""
    chunks = [_chunk(shape, "plain", i) for i, shape in enumerate(shapes)]
    expected = torch.cat([c.reshape(-1) for c in chunks])
    buf = torch.full((expected.numel(),), float("nan"))
    parts: list[tuple[int, int, torch.Tensor]] = []

    def on_part(part: torch.Tensor) -> None:
        offset = (part.data_ptr() - buf.data_ptr()) // buf.element_size()
        parts.append((offset, part.numel(), part.clone()))  # its values when handed out

    with _segment_bytes(segment):
        stack_into(buf, chunks, on_part=on_part)
    assert torch.equal(buf, expected)
    pos = 0
    for offset, numel, values in parts:
        assert offset == pos and torch.equal(values, expected[pos : pos + numel])
        pos += numel
    assert pos == expected.numel()


def test_the_workers_bucket_crcs_are_the_buckets() -> None:
    """`fill` with a `CaptureWorker`: each bucket's CRC-32C, chained by the worker over the parts as they
    were written, is the CRC-32C of the whole bucket (a copied one, a lone live chunk, an empty one)."""
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(4, 5, generator=g) for _ in range(6)] + [torch.randn(7, generator=g), torch.empty(0)]
    buckets = [
        ("float32", 6 * 20 + 7, [(i, 0) for i in range(7)]),
        ("float32", 20, [(0, 0)]),
        ("float32", 0, [(7, 0)]),
    ]
    worker = CaptureWorker()
    try:
        with _segment_bytes(48):
            filled = fill(buckets, chunks, worker=worker)
        got = worker.crcs(len(filled))
    finally:
        worker.close()
    assert got == [tensor_crc(b) for b in filled]
    assert len(set(got)) == 3


def test_the_worker_stages_large_tensors_and_reports_errors() -> None:
    """`CaptureWorker.stage` copies the tensors `HostPool.snapshot` takes (into the pool) and no other; a
    failed job's error is raised by the call that waits for it."""
    pool = HostPool()
    big, small, view = torch.randn(64 << 10), torch.randn(4), torch.randn(2, 64 << 10)[1]
    worker = CaptureWorker()
    try:
        worker.stage(pool, {"big": big, "small": small, "view": view, "other": 3})
        ((original, copy),) = worker.copies()
        worker.crc(0, "not a tensor")  # type: ignore[arg-type]
        with pytest.raises(AttributeError):
            worker.crcs(1)
    finally:
        worker.close()
    assert original is big and torch.equal(copy, big) and copy.data_ptr() != big.data_ptr()
    assert pool.allocated == 1


@contextlib.contextmanager
def _segment_bytes(n: int) -> Iterator[None]:
    old = bucketed.SEGMENT_BYTES
    bucketed.SEGMENT_BYTES = n
    try:
        yield
    finally:
        bucketed.SEGMENT_BYTES = old
