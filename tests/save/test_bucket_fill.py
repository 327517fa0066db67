"""``bucketed.fill``/``stack_into``: a bucket holds its chunks' values in order, element for element
what ``torch.cat`` of the flattened chunks gives, whatever their shapes, strides or autograd flags; the
halves the capture's worker fills (``sparse_ckpt._save.worker``), its CRCs and copies."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ckpt import _backend
from sparse_ckpt._format.bucket_checksums import crc_combine, tensor_crc
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
    st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(["plain", "transposed", "grad"])), max_size=14),
    st.integers(min_value=0, max_value=3),
    st.sampled_from([1, 64, 1 << 30]),
)
def test_the_workers_halves_and_crcs_are_the_buckets(
    spec: list[tuple[tuple[int, ...], str]], lone: int, split: int
) -> None:
    """`fill` with a `CaptureWorker`: every bucket holds what it holds without one, and its CRC-32C
    (combined from the two halves the two threads filled and checksummed, when it has at least
    ``SPLIT_BYTES``) is the CRC-32C of the whole bucket; also for a lone live chunk and an empty one."""
    chunks = [_chunk(shape, how, i) for i, (shape, how) in enumerate(spec)]
    alone = [torch.randn(lone), torch.empty(0)]
    members, pos = [], 0
    for i, c in enumerate(chunks):
        members.append((i, pos))
        pos += c.numel()
    buckets = [("float32", n, [(len(chunks) + j, 0)]) for j, n in enumerate((lone, 0))]
    if chunks:
        buckets.insert(0, ("float32", pos, members))
    local = [*chunks, *alone]
    want = fill(buckets, local)
    worker = CaptureWorker()
    try:
        with _split_bytes(split):
            got = fill(buckets, local, worker=worker)
        crcs = worker.crcs(len(got))
    finally:
        worker.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert crcs == [tensor_crc(b) for b in want]


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_a_failed_half_is_raised_by_crcs() -> None:
    """An error of the half the worker copies (here: a chunk of another size than the layout says)
    reaches the capture (`CaptureWorker.crcs`)."""
    chunks = [torch.randn(4, 4) for _ in range(4)]
    buckets = [("float32", 64, [(i, 16 * i) for i in range(4)])]
    worker = CaptureWorker()
    try:
        with _split_bytes(1):
            fill(buckets, chunks, sizes=[(4, 4), (4, 4), (4, 4), (2, 2)], worker=worker)
        with pytest.raises(AssertionError, match="chunks of 20 elements for a bucket of 32"):
            worker.crcs(1)
    finally:
        worker.close()


@contextlib.contextmanager
def _split_bytes(n: int) -> Iterator[None]:
    old = bucketed.SPLIT_BYTES
    bucketed.SPLIT_BYTES = n
    try:
        yield
    finally:
        bucketed.SPLIT_BYTES = old


@settings(max_examples=60, deadline=None)
@given(
    st.binary(max_size=300),
    st.binary(max_size=300),
    st.tuples(*[st.integers(min_value=0, max_value=2**32 - 1)] * 3),
    st.tuples(*[st.integers(min_value=0, max_value=1 << 40)] * 2),
)
def test_crc_combine_is_the_crc_of_the_concatenation(
    a: bytes, b: bytes, crcs: tuple[int, int, int], lengths: tuple[int, int]
) -> None:
    """`crc_combine` of two parts' CRC-32C is the CRC-32C of both; for parts of up to a TiB, combining
    is associative (three parts combine alike in either order)."""
    crc = _backend.core.crc32c
    assert crc_combine(crc(a), crc(b), len(b)) == crc(a + b)
    assert crc_combine(0, crc(b), len(b)) == crc(b)
    (x, y, z), (ny, nz) = crcs, lengths
    assert crc_combine(crc_combine(x, y, ny), z, nz) == crc_combine(x, crc_combine(y, z, nz), ny + nz)
