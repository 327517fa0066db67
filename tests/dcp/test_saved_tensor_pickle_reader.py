"""`sparse_ckpt._dcp.saved_tensor._read_pickle`, the one-tensor pickle interpreter split into one step
per opcode, reads every pickle as the single-loop interpreter it replaced did: the same value or the
same ``None``. The replaced interpreter is kept here, unchanged, as the reference; the inputs are real
``torch.save`` pickles, those pickles damaged, and random streams of the opcodes it reads."""

from __future__ import annotations

import io
import zipfile
from collections import OrderedDict
from typing import Any

import torch
from helpers import damaged
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ckpt._dcp.saved_tensor import _ORDERED_DICT, _REBUILD, _STORAGE_DTYPES, _read_pickle


def reference_read_pickle(data: bytes) -> Any:  # noqa: C901 -- the replaced implementation, kept whole
    """The value of the pickle ``data`` when it is what ``torch.save`` writes for one tensor, read by
    a small interpreter of the few protocol-2 opcodes that pickle uses; ``None`` for anything else.

    Nothing is unpickled in Python's sense: no global is resolved and nothing is called. A
    ``GLOBAL`` is kept as its ``(module, name)`` (only ``_rebuild_tensor_v2``, a legacy storage
    class or ``OrderedDict`` are accepted), ``REDUCE`` only records a call (``("call", global,
    args)``; ``OrderedDict`` only with no arguments), ``BINPERSID`` only records the storage's id
    (``("storage", pid)``). Values are ints, strs, bools and tuples."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    pos, n = 0, len(data)

    def take(k: int) -> bytes:
        nonlocal pos
        if pos + k > n:
            raise ValueError("truncated")
        out = data[pos : pos + k]
        pos += k
        return out

    def line() -> str:
        nonlocal pos
        end = data.find(b"\n", pos)
        if end < 0:
            raise ValueError("truncated")
        out = data[pos:end].decode("ascii")
        pos = end + 1
        return out

    def since_mark() -> tuple[Any, ...]:
        at = marks.pop()
        items = tuple(stack[at:])
        del stack[at:]
        return items

    try:
        while True:
            op = take(1)
            if op == b"\x80":  # PROTO
                if take(1)[0] > 2:
                    return None
            elif op == b"c":  # GLOBAL
                ref = (line(), line())
                if ref not in (_REBUILD, _ORDERED_DICT) and not (ref[0] == "torch" and ref[1] in _STORAGE_DTYPES):
                    return None
                stack.append(("global", ref))
            elif op == b"q":  # BINPUT
                memo[take(1)[0]] = stack[-1]
            elif op == b"r":  # LONG_BINPUT
                memo[int.from_bytes(take(4), "little")] = stack[-1]
            elif op == b"h":  # BINGET
                stack.append(memo[take(1)[0]])
            elif op == b"j":  # LONG_BINGET
                stack.append(memo[int.from_bytes(take(4), "little")])
            elif op == b"(":  # MARK
                marks.append(len(stack))
            elif op == b"X":  # BINUNICODE
                stack.append(take(int.from_bytes(take(4), "little")).decode("utf-8"))
            elif op == b"K":  # BININT1
                stack.append(take(1)[0])
            elif op == b"M":  # BININT2
                stack.append(int.from_bytes(take(2), "little"))
            elif op == b"J":  # BININT
                stack.append(int.from_bytes(take(4), "little", signed=True))
            elif op == b"\x8a":  # LONG1
                stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
            elif op == b")":  # EMPTY_TUPLE
                stack.append(())
            elif op in (b"\x85", b"\x86", b"\x87"):  # TUPLE1..3
                k = op[0] - 0x84
                if len(stack) < k:
                    return None
                items = tuple(stack[len(stack) - k :])
                del stack[len(stack) - k :]
                stack.append(items)
            elif op == b"t":  # TUPLE
                stack.append(since_mark())
            elif op == b"\x88":  # NEWTRUE
                stack.append(True)
            elif op == b"\x89":  # NEWFALSE
                stack.append(False)
            elif op == b"Q":  # BINPERSID
                stack.append(("storage", stack.pop()))
            elif op == b"R":  # REDUCE: recorded, never called
                args, fn = stack.pop(), stack.pop()
                if type(fn) is not tuple or fn[:1] != ("global",) or type(args) is not tuple:
                    return None
                if fn[1] == _ORDERED_DICT and args:
                    return None
                stack.append(("call", fn[1], args))
            elif op == b".":  # STOP
                return stack.pop() if pos == n and len(stack) == 1 and not marks else None
            else:
                return None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError):
        return None


def _pickle_of(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    archive = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float8_e4m3fn]
_SHAPES = [(), (1,), (3, 4), (2, 1, 3), (300,), (70000,)]


def _real_pickles() -> list[bytes]:
    """What ``torch.save`` writes: plain tensors, a strided view, one needing grad, a v3 dtype, a dict."""
    out = [_pickle_of(torch.zeros(s, dtype=d)) for d in _DTYPES for s in _SHAPES[:4]]
    out.append(_pickle_of(torch.zeros(70000)))
    out.append(_pickle_of(torch.zeros(4, 3).t()))
    out.append(_pickle_of(torch.zeros(3, requires_grad=True)))
    out.append(_pickle_of(torch.zeros(8)[2:5]))
    out.append(_pickle_of({"a": torch.zeros(2)}))
    out.append(_pickle_of(OrderedDict()))
    return out


REAL = _real_pickles()


def test_real_pickles_read_the_same() -> None:
    taken = 0
    for pkl in REAL:
        assert _read_pickle(pkl) == reference_read_pickle(pkl)
        taken += reference_read_pickle(pkl) is not None
    assert taken >= 20  # the plain ones are read, not all refused


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_damaged_real_pickles_read_the_same(data: st.DataObject) -> None:
    blob = damaged(data, data.draw(st.sampled_from(REAL)))
    assert _read_pickle(blob) == reference_read_pickle(blob)


def _global(ref: tuple[str, str]) -> bytes:
    return b"c" + ref[0].encode() + b"\n" + ref[1].encode() + b"\n"


_GLOBALS = [_REBUILD, _ORDERED_DICT, ("torch", "FloatStorage"), ("os", "system"), ("torch", "UntypedStorage")]
_PIECES = st.one_of(
    st.sampled_from([b"(", b")", b"t", b"\x85", b"\x86", b"\x87", b"\x88", b"\x89", b"Q", b"R", b".", b"N", b"}"]),
    st.sampled_from(_GLOBALS).map(_global),
    st.sampled_from([b"\x80\x02", b"\x80\x03", b"\x80"]),
    st.builds(lambda k: b"K" + bytes([k]), st.integers(0, 255)),
    st.builds(lambda k: b"M" + k.to_bytes(2, "little"), st.integers(0, 65535)),
    st.builds(lambda k: b"J" + k.to_bytes(4, "little", signed=True), st.integers(-(2**31), 2**31 - 1)),
    st.builds(lambda b: b"\x8a" + bytes([len(b)]) + b, st.binary(max_size=9)),
    st.builds(lambda b: b"X" + len(b).to_bytes(4, "little") + b, st.binary(max_size=6)),
    st.builds(lambda k: b"q" + bytes([k]), st.integers(0, 3)),
    st.builds(lambda k: b"h" + bytes([k]), st.integers(0, 3)),
    st.builds(lambda k: b"r" + k.to_bytes(4, "little"), st.integers(0, 3)),
    st.builds(lambda k: b"j" + k.to_bytes(4, "little"), st.integers(0, 3)),
    st.binary(min_size=1, max_size=3),
)


@settings(max_examples=1500, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=24))
def test_random_opcode_streams_read_the_same(pieces: list[bytes]) -> None:
    blob = b"".join(pieces)
    for data in (blob, blob + b"."):
        assert _read_pickle(data) == reference_read_pickle(data)


def test_every_opcode_branch_is_reached() -> None:
    """The hand-made streams that reach each branch of the reference (a value, or each refusal)."""
    storage = _global(("torch", "FloatStorage"))
    cases = [
        b"\x80\x02" + _global(_ORDERED_DICT) + b")R.",  # OrderedDict()
        b"\x80\x02" + _global(_ORDERED_DICT) + b"K\x01\x85R.",  # OrderedDict with arguments
        b"\x80\x03.",  # protocol 3
        b"K\x01q\x00h\x00\x86.",  # memo put/get
        b"K\x01r\x00\x00\x00\x00j\x00\x00\x00\x00\x86.",  # long memo put/get
        b"(K\x01M\x02\x00J\xff\xff\xff\xff\x8a\x01\x80t.",  # mark, ints, tuple
        b"(X\x02\x00\x00\x00ab" + storage + b"\x88\x89\x87Q\x85.",  # str, globals, bools, persid
        b"K\x01K\x02R.",  # REDUCE of a non-global
        b"\x87.",  # TUPLE3 on a short stack
        b"K\x01K\x02.",  # STOP with two items
        b"K\x01.K",  # STOP before the end
        b"(K\x01.",  # STOP with an open mark
        b"X\x01\x00\x00\x00\xff.",  # bad utf-8
        b"h\x07.",  # memo miss
        b"Q.",  # empty stack
        b"N.",  # an opcode it does not read
        b"",  # truncated
    ]
    results = [reference_read_pickle(c) for c in cases]
    assert any(r is not None for r in results) and any(r is None for r in results)
    for case, expected in zip(cases, results):
        assert _read_pickle(case) == expected, case
