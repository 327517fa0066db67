"""`sparse_ckpt._dcp.saved_tensor.read_saved_tensor`: a DCP item's tensor read with one ``readinto``
where it is the plain case, ``None`` (the caller's ``torch.load``) for everything else, and
`sparse_ckpt._host_memory.empty_host`, the buffers it reads into."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import damaged
from hypothesis import given, settings
from hypothesis import strategies as st

import sparse_ckpt._host_memory as host_memory
from sparse_ckpt._dcp import saved_tensor
from sparse_ckpt._dcp.saved_tensor import read_saved_tensor

LEGACY = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex128,
    torch.complex64,
]


def _write(path: Path, value: Any, junk: int = 37) -> tuple[int, int]:
    """``torch.save(value)`` after ``junk`` bytes of another item, as a DCP file holds it: (offset, length)."""
    with open(path, "wb") as f:
        f.write(os.urandom(junk))
        offset = f.tell()
        torch.save(value, f)
        length = f.tell() - offset
        f.write(os.urandom(11))
    return offset, length


def _read(path: Path, where: tuple[int, int], size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    with open(path, "rb") as f:
        return read_saved_tensor(f, *where, size, dtype)


def _sample(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (
        (torch.randn(size) * 100).to(dtype)
        if dtype.is_floating_point or dtype.is_complex
        else torch.randint(0, 2 if dtype == torch.bool else 100, size).to(dtype)
    )


@pytest.mark.parametrize("dtype", LEGACY, ids=str)
@pytest.mark.parametrize("size", [(1,), (7,), (3, 5), (1, 4), (4, 1), (2, 1, 3), ()], ids=str)
def test_plain_tensors_are_read_by_the_fast_path(tmp_path: Path, dtype: torch.dtype, size: tuple[int, ...]) -> None:
    """Every dtype torch saves with a legacy storage class, every shape: read, bit-exact (and not
    ``None``: a torch release that changes ``torch.save``'s archive fails here, not silently slow)."""
    t = _sample(size, dtype)
    where = _write(tmp_path / "f", t)
    got = _read(tmp_path / "f", where, size, dtype)
    assert got is not None, f"torch {torch.__version__}'s torch.save archive is not read by the fast path"
    assert got.dtype == dtype and tuple(got.shape) == size and got.is_contiguous()
    assert torch.equal(got.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_large_buffer_is_read_whole(tmp_path: Path) -> None:
    t = torch.randn(3 << 20)  # 12 MiB: over two huge pages, so on advised memory
    where = _write(tmp_path / "f", t, junk=4096 + 5)
    got = _read(tmp_path / "f", where, tuple(t.shape), t.dtype)
    assert got is not None and torch.equal(got, t)


@pytest.mark.parametrize(
    "value, size, dtype",
    [
        (torch.arange(12.0).view(3, 4).t(), (4, 3), torch.float32),  # strides of a transpose
        (torch.arange(12.0)[2:], (10,), torch.float32),  # a view into a larger storage
        (torch.arange(6.0).requires_grad_(), (6,), torch.float32),
        (torch.zeros(4, dtype=torch.float8_e4m3fn), (4,), torch.float8_e4m3fn),  # _rebuild_tensor_v3
        (torch.zeros(4, dtype=torch.uint16), (4,), torch.uint16),
        (torch.arange(6.0), (6,), torch.float64),  # not the dtype the metadata says
        (torch.arange(6.0), (2, 3), torch.float32),  # not the shape the metadata says
        (torch.arange(6.0), (7,), torch.float32),
        (torch.zeros(0), (0,), torch.float32),  # no bytes
        ({"t": torch.arange(6.0)}, (6,), torch.float32),  # not a tensor
        ([torch.arange(6.0), torch.arange(6.0)], (6,), torch.float32),
    ],
    ids=[
        "transposed",
        "offset_view",
        "requires_grad",
        "float8",
        "uint16",
        "dtype",
        "shape",
        "numel",
        "empty",
        "dict",
        "list",
    ],
)
def test_everything_else_is_left_to_torch_load(
    tmp_path: Path, value: Any, size: tuple[int, ...], dtype: torch.dtype
) -> None:
    where = _write(tmp_path / "f", value)
    assert _read(tmp_path / "f", where, size, dtype) is None


def test_damaged_archives_are_left_to_torch_load(tmp_path: Path) -> None:
    """A cut central directory, bytes that are no archive, a record stored compressed, another byte
    order: ``None``."""
    t = torch.arange(64.0)
    offset, length = _write(tmp_path / "f", t)
    raw = (tmp_path / "f").read_bytes()
    item = raw[offset : offset + length]

    def compressed(record: str) -> bytes:
        """The archive with ``record``'s central directory entry saying "deflated"."""
        blob = bytearray(item)
        at = item.find(b"PK\x01\x02")
        while at >= 0:
            name_len = int.from_bytes(item[at + 28 : at + 30], "little")
            if item[at + 46 : at + 46 + name_len].decode().endswith(record):
                blob[at + 10] = 8
                return bytes(blob)
            at = item.find(b"PK\x01\x02", at + 1)
        raise AssertionError(record)

    cases = {
        "cut_tail": item[:-30],
        "no_archive": os.urandom(length),
        "compressed_data": compressed("/data/0"),
        "compressed_pickle": compressed("/data.pkl"),
        "compressed_byteorder": compressed("/byteorder"),
        "big_endian": item.replace(b"little", b"bigend", 1),
    }
    for name, blob in cases.items():
        p = tmp_path / name
        p.write_bytes(blob)
        with open(p, "rb") as f:
            assert read_saved_tensor(f, 0, len(blob), (64,), torch.float32) is None, name


def test_the_pickle_reader_builds_nothing(tmp_path: Path) -> None:
    """A data.pkl naming any other global (here ``os.system``) is refused by the restricted
    unpickler before anything is called: ``None`` (torch.load's weights-only unpickler then refuses it)."""

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    assert saved_tensor._plain_tensor(pickle.dumps(Evil(), protocol=2), (1,), torch.float32) is False
    assert not (tmp_path / "pwned").exists()


def test_short_read_is_an_error(tmp_path: Path) -> None:
    t = torch.arange(1000.0)
    where = _write(tmp_path / "f", t)

    class Short(io.FileIO):
        def readinto(self, b: Any) -> int:
            n = super().readinto(b)
            return n - 1 if n and n >= t.numel() * 4 else n

    with Short(tmp_path / "f", "rb") as f, pytest.raises(EOFError, match="3999 of 4000 bytes"):
        read_saved_tensor(f, *where, (1000,), torch.float32)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(LEGACY + [torch.float8_e5m2]),
    size=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    transpose=st.booleans(),
    junk=st.integers(0, 200),
    expect_dtype=st.sampled_from([None, torch.float32, torch.int64]),
)
def test_agrees_with_torch_load(
    tmp_path_factory: pytest.TempPathFactory,
    dtype: torch.dtype,
    size: tuple[int, ...],
    transpose: bool,
    junk: int,
    expect_dtype: torch.dtype | None,
) -> None:
    """Differential: whenever the fast path returns a tensor, it is bit for bit what ``torch.load``
    reads, with the dtype and shape asked for."""
    t = _sample(size, dtype) if dtype != torch.float8_e5m2 else torch.randn(size).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)
    path = tmp_path_factory.mktemp("d") / "f"
    offset, length = _write(path, t, junk)
    want_dtype = expect_dtype or dtype
    got = _read(path, (offset, length), tuple(t.shape), want_dtype)
    if got is None:
        return
    with open(path, "rb") as f:
        f.seek(offset)
        ref = torch.load(io.BytesIO(f.read(length)), weights_only=True)
    assert ref.dtype == got.dtype == want_dtype and ref.shape == got.shape
    assert torch.equal(ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))


def test_dcp_items_take_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The items a FileSystemWriter writes are the plain case: a buffers load reads its buckets
    with one ``readinto`` each and never falls back to ``torch.load``."""
    from helpers import assert_optimizer_equal, make_moe, train

    import sparse_ckpt as sc

    model = make_moe(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, 2, only_experts=[0, 1])
    dcp.save({"optim": sc.SparseOptimizerState(model, opt, state_layout="buffers")}, checkpoint_id=tmp_path / "c")
    fast: list[tuple[int, ...]] = []
    real = saved_tensor.read_saved_tensor

    def counted(*args: Any) -> Any:
        out = real(*args)
        fast.append(tuple(args[3]) if out is not None else ("fallback",))
        return out

    monkeypatch.setattr("sparse_ckpt._dcp.items.read_saved_tensor", counted)
    model2 = make_moe(0)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    dcp.load(
        {"optim": sc.SparseOptimizerState(model2, opt2)}, checkpoint_id=tmp_path / "c", planner=sc.SparseLoadPlanner()
    )
    assert_optimizer_equal(opt2, opt, grads=False)
    assert fast and ("fallback",) not in fast, fast


def test_empty_host_advises_only_its_own_aligned_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)  # the default: advised
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(host_memory, "_MADVISE", lambda a, n, advice: calls.append((a, n, advice)) or 0)
    monkeypatch.setattr(host_memory, "_MADV_HUGEPAGE", 14)
    huge = host_memory.HUGE_PAGE_BYTES
    small = host_memory.empty_host((2 * huge - 4) // 4, torch.float32)
    assert calls == [] and small.numel() == (2 * huge - 4) // 4
    big = host_memory.empty_host((3, huge // 2), torch.int16)
    assert big.shape == (3, huge // 2) and big.dtype == torch.int16
    ((start, n, advice),) = calls
    assert advice == 14 and start % huge == 0 and n % huge == 0 and n > 0
    assert big.data_ptr() <= start and start + n <= big.data_ptr() + big.numel() * 2
    big.fill_(3)
    assert int(big.sum()) == 3 * big.numel()


def test_empty_host_without_madvise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_MADVISE", None)
    t = host_memory.empty_host(5 << 20, torch.uint8)
    assert t.numel() == 5 << 20 and t.dtype == torch.uint8


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_pickle_reader_never_raises_on_damaged_pickles(data: st.DataObject) -> None:
    """Any byte changed, cut or inserted in a real tensor pickle: a bool, never an exception (and
    only the untouched pickle, or a change that keeps its meaning, is the plain case)."""
    buf = io.BytesIO()
    torch.save(torch.zeros(3, 4), buf)
    import zipfile

    pkl = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data.pkl")
    assert saved_tensor._plain_tensor(pkl, (3, 4), torch.float32) is True
    assert saved_tensor._plain_tensor(damaged(data, pkl), (3, 4), torch.float32) in (True, False)


@pytest.mark.parametrize(
    ("env", "wanted"), [(None, True), ("1", True), ("on", True), (" ON ", True), ("0", False), ("off", False)]
)
def test_huge_pages_wanted(monkeypatch: pytest.MonkeyPatch, env: str | None, wanted: bool) -> None:
    if env is None:
        monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    else:
        monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, env)
    assert host_memory.huge_pages_wanted() is wanted


def test_huge_pages_env_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "maybe")
    with pytest.raises(ValueError, match="SPARSE_CKPT_HUGE_PAGES='maybe': expected 1/on or 0/off"):
        host_memory.huge_pages_wanted()


def test_empty_host_without_the_advice_when_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(host_memory, "_MADVISE", lambda a, n, advice: calls.append((a, n, advice)) or 0)
    monkeypatch.setattr(host_memory, "_MADV_HUGEPAGE", 14)
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    t = host_memory.empty_host(8 << 20, torch.uint8)
    assert calls == [] and t.numel() == 8 << 20
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "1")
    host_memory.empty_host(8 << 20, torch.uint8)
    assert len(calls) == 1
