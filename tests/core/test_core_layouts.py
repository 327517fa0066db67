"""Differential tests of the buffers-layout core functions (``encode_layout``, ``decode_layout``,
``plan_scatter``): the C++ core against the Python reference, with random and hand-written
inputs, and the scatter plan checked by running it on real tensors.

Like tests/core/test_core_differential.py, the module runs once (both cores are called directly).
"""

from __future__ import annotations

import math
import random
from typing import Any

import _backends
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core_differential import PROPS as DIFFERENTIAL_PROPS  # (skips this module too when _C is not built)
from test_core_differential import check, check_error, same

from sparse_ckpt import _core_py as P
from sparse_ckpt._core_py.layout_codec import LAYOUT_MAGIC
from sparse_ckpt.errors import CheckpointFormatError, CheckpointMismatchError

PROPS = settings(DIFFERENTIAL_PROPS, max_examples=200)
"""The differential tests' settings (derandomized, no deadline, no database), fewer examples."""
DTYPES = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}


core_backend = _backends.both_cores_directly


@st.composite
def chunk(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    offsets, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offsets.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return shape, tuple(offsets), tuple(sizes)


@st.composite
def entries(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    names = draw(
        st.lists(
            st.tuples(st.sampled_from(["a", "b.w", "é", "c"]), st.sampled_from(["exp_avg", "~i7", "m.x"])),
            unique=True,
            max_size=6,
        )
    )
    out = []
    for fqn, key in names:
        dtype = draw(st.sampled_from(list(DTYPES)))
        out.append((fqn, key, dtype, DTYPES[dtype], *draw(chunk())))
    return out


@PROPS
@given(entries(), st.sampled_from([1, 7, 64, 10**9, 2**80]))
def test_encode_decode_layout(ents: list[tuple[Any, ...]], bucket_bytes: int) -> None:
    res = check("encode_layout", "leaf", ents, bucket_bytes)
    assert res[0] == "ok"
    table, buckets = res[1]
    decoded = check("decode_layout", "leaf", table)[1]
    assert [(d, n) for d, n, _e in decoded] == [(d, n) for d, n, _m in buckets]
    for (_d, _n, members), (_d2, _n2, got) in zip(buckets, decoded):
        assert [ents[i][:2] + ents[i][4:] for i, _o in members] == got
        sizes = [math.prod(ents[i][6]) for i, _o in members]
        assert [o for _i, o in members] == [sum(sizes[:k]) for k in range(len(sizes))]
        nbytes = [s * ents[i][3] for s, (i, _o) in zip(sizes, members)]
        assert len(members) == 1 or sum(nbytes) <= bucket_bytes
    assert sorted(i for _d, _n, m in buckets for i, _o in m) == list(range(len(ents)))


BAD_ENTRIES = [
    [("a", "k", "float32", 4, (2,), (1,), (2,))],  # outside its shape
    [("a", "k", "float32", 4, (2,), (0,), (2,)), ("a", "k", "bfloat16", 2, (2,), (0,), (1,))],  # twice
    [("a", "k", "float32", 0, (2,), (0,), (2,))],
    [("a", "k", "float32", 2**70, (2,), (0,), (2,))],
    [("a", "k", "float32", 4, (2, 2), (0,), (2,))],
    [("a", "k", "float32", 4, (2**63,), (0,), (1,))],
    [("a", "k", "float32", 4, (2**62, 4), (0, 0), (1, 1))],
    [("a", "k", "float32", 4, (-1,), (0,), (0,))],
    [("a", "k", "float32", 4, (3,), (2**70,), (0,))],
    [("a", "k", "float32", 4, (1,) * 65, (0,) * 65, (1,) * 65)],
    [("a\ud800", "k", "float32", 4, (1,), (0,), (1,))],
    [("a", "k", "\udc00", 4, (1,), (0,), (1,))],
    [("a", "k\udfff", "float32", 4, (1,), (0,), (1,))],
]


@pytest.mark.parametrize("bad", BAD_ENTRIES)
def test_encode_layout_refusals(bad: list) -> None:
    check_error("encode_layout", "leaf", bad, 64, exc=CheckpointFormatError, match="leaf 'leaf'")


@pytest.mark.parametrize(
    "args",
    [
        (1, [], 1),
        ("l", "x", 1),
        ("l", [], 0),
        ("l", [], True),
        ("l", [], 1.0),
        ("l", [("a",)], 1),
        ("l", [["a", "k", "f", 4, (1,), (0,), (1,)]], 1),
        ("l", [(1, "k", "f", 4, (1,), (0,), (1,))], 1),
        ("l", [("a", "k", "f", 4.0, (1,), (0,), (1,))], 1),
        ("l", [("a", "k", "f", 4, (1.0,), (0,), (1,))], 1),
        ("l", [("a", "k", "f", 4, 1, (0,), (1,))], 1),
        ("l", [("a", 1, "f", 4, (1,), (0,), (1,))], 1),
        ("l", [("a", "k", None, 4, (1,), (0,), (1,))], 1),
        ("l", [("a", "k", "f", 4, (1,), (0,))], 1),
        ("l", [("a", "k", "f", 4, (1,), 0, (1,))], 1),
        ("l", [("a", "k", "f", 4, (1,), (0,), None)], 1),
        ("l", (), -5),
    ],
)
def test_encode_layout_outside_the_contract(args: tuple) -> None:
    res = check("encode_layout", *args)
    assert res[0] == "err" and res[1] in (TypeError, ValueError), res


# Names of every str kind (1, 2 and 4 bytes per character); each use below builds a new str object,
# so equal names are equal strs that are distinct objects.
_NAMES = ["a", "b.w", "é.w", "ā", "\U0001f600.x"]
_KEYS = ["exp_avg", "exp_avg_sq", "~i7", "ключ"]
_BAD_CHUNK = ((2,), (1,), (2,))  # not inside its shape


@st.composite
def shared_entries(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """Entries as ``bucketed.collect`` makes them: a few chunk tuples shared (the same objects) by
    many entries, some passed as equal copies or lists instead; names and dtypes repeat as equal
    but distinct strs; now and then a duplicate, a bad item size, a bad chunk or an unencodable FQN."""
    pool = draw(st.lists(chunk(), min_size=1, max_size=4))
    if draw(st.integers(0, 9)) == 0:
        pool.append(_BAD_CHUNK)
    dtypes = [f"dt{i}" for i in range(draw(st.integers(1, 12)))]
    out = []
    for _ in range(draw(st.integers(0, 40))):
        fqn = draw(st.sampled_from(_NAMES)) + str(draw(st.integers(0, 60)))
        if draw(st.integers(0, 29)) == 0:
            fqn += "\ud800"
        key = "".join(draw(st.sampled_from(_KEYS)))
        dtype = "".join(draw(st.sampled_from(dtypes)))
        c = draw(st.sampled_from(pool))
        how = draw(st.integers(0, 5))
        if how == 3:  # its shape and offsets tuples with another chunk's sizes tuple
            c = (c[0], c[1], draw(st.sampled_from(pool))[2])
        elif how == 4:
            c = tuple((*d,) for d in c)  # equal dims, other objects (a new tuple each)
        elif how == 5:
            c = tuple(list(d) for d in c)
        out.append((fqn, key, dtype, draw(st.sampled_from([4, 2, 8, 1, 16, 4, 0, 17])), *c))
    return out


@PROPS
@given(shared_entries(), st.sampled_from([1, 64, 10**9]))
def test_encode_layout_shared_chunks_and_names(ents: list[tuple[Any, ...]], bucket_bytes: int) -> None:
    """Chunk tuples shared by many entries (read once by the C++ core), equal names as distinct strs,
    many dtypes, non-ASCII and unencodable names: both cores give the same table and buckets or the
    same error."""
    res = check("encode_layout", "leaf", ents, bucket_bytes)
    assert res[0] == "ok" or res[1] is CheckpointFormatError, res


def test_encode_layout_at_scale() -> None:
    """Thousands of entries over a few shared chunks, then duplicates far apart (past any cache of
    recent chunks or names) and a shared chunk met again after many others: the cores agree."""
    shapes = [(n, 3) for n in range(1, 21)]
    chunks = [(s, (0, 0), s) for s in shapes]
    ents = [
        (
            f"layers.{i}.w{'é' if i % 3 else ''}",
            k,
            "float32" if i % 5 else "bfloat16",
            4 if i % 5 else 2,
            *chunks[i % len(chunks)],
        )
        for i in range(1500)
        for k in ("exp_avg", "exp_avg_sq")
    ]
    table, buckets = check("encode_layout", "leaf", ents, 4096)[1]
    assert sum(len(m) for _d, _n, m in buckets) == len(ents)
    assert check("decode_layout", "leaf", table)[0] == "ok"
    for at, first in ((2999, 0), (2000, 1999), (1501, 7)):
        twice = [*ents[:at], (str(ents[first][0]), "".join(ents[first][1]), *ents[at][2:]), *ents[at + 1 :]]
        check_error("encode_layout", "leaf", twice, 4096, exc=CheckpointFormatError, match="listed twice in one layout")
    late = [*ents, ("z", "k", "float32", 0, *chunks[0])]  # a shared chunk, known good, with a bad item size
    check_error("encode_layout", "leaf", late, 4096, exc=CheckpointFormatError, match="item size 0")
    bad = [*ents, ("z", "k", "float32", 4, *_BAD_CHUNK), ("y", "k", "float32", 4, *_BAD_CHUNK)]
    check_error("encode_layout", "leaf", bad, 4096, exc=CheckpointFormatError, match="state 'k' of 'z'")
    shape, zeros = (4, 3), (0, 0)  # one shape and offsets tuple, sizes tuples apart (the last outside the shape)
    rows = [(f"r{i}", "k", "float32", 4, shape, zeros, (i % 6, 3)) for i in range(40)]
    check("encode_layout", "leaf", rows[:5], 64)
    check_error("encode_layout", "leaf", rows, 64, exc=CheckpointFormatError, match="state 'k' of 'r5'")
    many = [(f"p{i}", "k", f"dtype{i % 97}", 1 + i % 16, *chunks[i % 3]) for i in range(2000)]
    assert len(check("encode_layout", "leaf", many, 64)[1][1]) >= 97
    odd = [*ents, ("\ud800", "k", "float32", 4, *chunks[0])]  # unencodable: refused when written, last
    check_error("encode_layout", "leaf", odd, 10**9, exc=CheckpointFormatError, match="not valid unicode")


def _shard_layouts(shape: tuple[int, ...], parts: int, rng: random.Random, dtype: str = "float32") -> list[bytes]:
    """Layouts of ``parts`` saving ranks that split dim 0 of two tensors of ``shape`` (FSDP-like,
    uneven), each in a bucket of 40 bytes at most."""
    rows = shape[0]
    cuts = sorted(rng.randint(0, rows) for _ in range(parts - 1))
    bounds = [0, *cuts, rows]
    out = []
    for r in range(parts):
        lo, hi = bounds[r], bounds[r + 1]
        ents = [
            (fqn, key, dtype, DTYPES[dtype], shape, (lo, *(0 for _ in shape[1:])), (hi - lo, *shape[1:]))
            for fqn in ("p", "q")
            for key in ("exp_avg", "exp_avg_sq")
        ]
        out.append(P.encode_layout("leaf", ents, 40)[0])
    return out


def _run(plan: Any, layouts: list[bytes], values: dict[tuple[str, str], torch.Tensor]) -> list[torch.Tensor]:
    """Execute a scatter plan on real buffers built from ``values`` (the global tensors)."""
    targets, sources, ops = plan
    bufs = []
    for li, data in enumerate(layouts):
        for _dtype, _numel, entries in P.decode_layout("leaf", data):
            bufs.append(
                (
                    (li, len([b for b in bufs if b[0][0] == li])),
                    torch.cat(
                        [
                            values[(f, k)][tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
                            for f, k, _shape, offs, sizes in entries
                        ]
                        or [torch.empty(0)]
                    ),
                )
            )
    by_id = dict(bufs)
    out = [torch.full(t[5], float("nan")) for t in targets]
    for si, src_off, src_sizes, src_start, ti, dst_start, box in ops:
        li, bi, _d, _n = sources[si]
        src = by_id[(li, bi)][src_off : src_off + math.prod(src_sizes)].view(src_sizes)
        src = src[tuple(slice(a, a + b) for a, b in zip(src_start, box))]
        out[ti][tuple(slice(a, a + b) for a, b in zip(dst_start, box))] = src
    return out


@pytest.mark.parametrize("seed", range(25))
def test_scatter_plan_reshards_exactly(seed: int) -> None:
    """Saved by 1-4 ranks, loaded as 1-4 (uneven) chunks: the plan copies exactly every element."""
    rng = random.Random(seed)
    shape = (rng.randint(1, 7), rng.randint(1, 3))
    layouts = _shard_layouts(shape, rng.randint(1, 4), rng)
    if rng.random() < 0.3:
        layouts.append(layouts[0])  # a replica's identical layout: its chunks are used once
    values = {
        (f, k): torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 100 * i
        for i, (f, k) in enumerate((f, k) for f in ("p", "q") for k in ("exp_avg", "exp_avg_sq"))
    }
    lo = rng.randint(0, shape[0])
    hi = rng.randint(lo, shape[0])
    mine = {"p": (shape, (lo, 0), (hi - lo, shape[1])), "q": (shape, (0, 0), shape)}
    plan = check("plan_scatter", "leaf", layouts, lambda f: mine.get(f))[1]
    targets, sources, _ops = plan
    assert [(t[0], t[1]) for t in targets] == [
        ("p", "exp_avg"),
        ("p", "exp_avg_sq"),
        ("q", "exp_avg"),
        ("q", "exp_avg_sq"),
    ]
    assert len({(li, bi) for li, bi, _d, _n in sources}) == len(sources)
    for t, got in zip(targets, _run(plan, layouts, values)):
        fqn, key, _dtype, _shape, offs, sizes = t
        want = values[(fqn, key)][tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        assert torch.equal(got, want), (fqn, key)


def test_scatter_plan_refusals() -> None:
    rng = random.Random(0)
    full = _shard_layouts((4, 2), 2, rng)
    mine = {"p": ((4, 2), (0, 0), (4, 2))}
    check_error(
        "plan_scatter",
        "leaf",
        full[:1],
        lambda f: mine.get(f),
        exc=CheckpointMismatchError,
        match="the checkpoint's buffers cover",
    )
    check_error(
        "plan_scatter",
        "leaf",
        full,
        lambda f: {"p": ((5, 2), (0, 0), (5, 2))}.get(f),
        exc=CheckpointMismatchError,
        match="has shape (4, 2) in the checkpoint, the parameter (5, 2)",
    )
    other = _shard_layouts((4, 2), 1, rng, dtype="bfloat16")
    check_error(
        "plan_scatter",
        "leaf",
        [*full, *other],
        lambda f: mine.get(f),
        exc=CheckpointFormatError,
        match="layout tables disagree on state 'exp_avg' of 'p'",
    )
    for answer in (
        (1, 2),
        ((4, 2), (0, 0)),
        ((4, 2), (0, 0), (5, 2)),
        ((4,), (0, 0), (4, 2)),
        ((4.0, 2), (0, 0), (4, 2)),
        [(4, 2), (0, 0), (4, 2)],
        "x",
    ):
        res = check("plan_scatter", "leaf", full, lambda f, a=answer: a)
        assert res[0] == "err" and res[1] in (TypeError, ValueError), res
    res = check("plan_scatter", "leaf", full, lambda f: 1 / 0)
    assert res[0] == "err" and res[1] is ZeroDivisionError
    for bad in ([b"x"], ["x"], "x", [bytearray(full[0])]):
        assert check("plan_scatter", "leaf", bad, lambda f: None)[0] == "err"


@PROPS
@given(st.data())
def test_damaged_layouts_fail_alike(data: st.DataObject) -> None:
    """Flipped, cut or extended tables: both cores give the same outcome, only format errors."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    table = _shard_layouts((rng.randint(1, 5), 2), 1, rng)[0]
    kind = data.draw(st.sampled_from(["flip", "cut", "extend", "count"]))
    if kind == "flip":
        at = data.draw(st.integers(0, len(table) - 1))
        bad = table[:at] + bytes([table[at] ^ data.draw(st.integers(1, 255))]) + table[at + 1 :]
    elif kind == "cut":
        bad = table[: data.draw(st.integers(0, len(table) - 1))]
    elif kind == "extend":
        bad = table + data.draw(st.binary(min_size=1, max_size=8))
    else:
        bad = table[:6] + (0xFFFFFFFF).to_bytes(4, "little") + table[10:]
    res = check("decode_layout", "leaf", bad)
    assert res[0] == "ok" or res[1] is CheckpointFormatError, res
    res2 = check("plan_scatter", "leaf", [bad], lambda f: None)
    assert res2[0] == "ok" or res2[1] is CheckpointFormatError, res2


def test_decode_layout_edge_cases() -> None:
    check_error("decode_layout", "leaf", b"", exc=CheckpointFormatError, match="truncated layout reading magic")
    check_error("decode_layout", "leaf", b"SCKT\x01\x00", exc=CheckpointFormatError, match="bad magic")
    check_error(
        "decode_layout", "leaf", LAYOUT_MAGIC + b"\x02\x00", exc=CheckpointFormatError, match="unsupported version 2"
    )
    empty = check("decode_layout", "leaf", LAYOUT_MAGIC + b"\x01\x00" + b"\x00" * 4)
    assert empty == ("ok", [])
    table = P.encode_layout(
        "leaf", [("a", "k", "float32", 4, (2,), (0,), (2,)), ("a", "k2", "float32", 4, (2,), (0,), (2,))], 64
    )[0]
    twice = table.replace(b"k2", b"k\x00", 1).replace(b"\x02\x00\x00\x00k\x00", b"\x01\x00\x00\x00k", 1)
    assert check("decode_layout", "leaf", twice)[0] == "err"
    for bad in (1, "x", bytearray(table)):
        assert check("decode_layout", "leaf", bad)[0] == "err"
    assert same(
        check("decode_layout", "leaf", table)[1],
        [("float32", 4, [("a", "k", (2,), (0,), (2,)), ("a", "k2", (2,), (0,), (2,))])],
    )


# --------------------------------------------------------------------------- recorded keys


@PROPS
@given(
    st.dictionaries(
        st.sampled_from(["a", "b", "c.d", "é"]),
        st.tuples(st.tuples(*[st.sampled_from(["step", "exp_avg", "~i7", "m.x"])] * 2), st.just("leaf")),
    ),
    st.dictionaries(
        st.sampled_from(["a", "b", "c.d", "é", "z"]),
        st.dictionaries(st.sampled_from(["exp_avg", "step", "m", 7]), st.just(0)),
    ),
    st.sets(st.sampled_from(["a", "b", "c.d", "z"])),
)
def test_unlisted_keys(keys_of: dict, state_of: dict, owned: set) -> None:
    res = check("unlisted_keys", keys_of, state_of, dict.fromkeys(owned))
    assert res[1] == [
        (f, k) for f, (keys, _l) in keys_of.items() if f in owned for k in keys if k not in state_of.get(f, {})
    ]


@pytest.mark.parametrize(
    "args",
    [
        ([], {}, {}),
        ({}, [], {}),
        ({}, {}, set()),
        ({"a": ["k"]}, {}, {"a": 1}),
        ({"a": (["k"], "l")}, {}, {"a": 1}),
        ({"a": (("k",), "l")}, {"a": [1]}, {"a": 1}),
        ({"a": (("k",),)}, {}, {"a": 1}),
    ],
)
def test_unlisted_keys_outside_the_contract(args: tuple) -> None:
    res = check("unlisted_keys", *args)
    assert res[0] == "err" and res[1] is TypeError, res


# --------------------------------------------------------------------------- exact cover, hostile inputs


def _rows(lo: int, hi: int, shape: tuple[int, int] = (10, 2)) -> bytes:
    return P.encode_layout("leaf", [("p", "exp_avg", "float32", 4, shape, (lo, 0), (hi - lo, shape[1]))], 1 << 20)[0]


def test_overlapping_layouts_with_a_gap_are_refused() -> None:
    """Rows [0,6) and [4,8) of a 10x2 state hold 12 + 8 = 20 elements, as many as the tensor: a
    count does not see that rows 4-5 come twice and rows 8-9 never."""
    whole = ((10, 2), (0, 0), (10, 2))
    check_error(
        "plan_scatter",
        "leaf",
        [_rows(0, 6), _rows(4, 8)],
        lambda f: whole,
        exc=CheckpointMismatchError,
        match="leaf 'leaf': state 'exp_avg' of 'p': the checkpoint's layouts overlap (chunks at offsets (0, 0) "
        "of sizes (6, 2) and at offsets (4, 0) of sizes (4, 2))",
    )
    # a chunk of this rank that only the overlap touches: refused too; one the overlap misses loads
    check_error(
        "plan_scatter",
        "leaf",
        [_rows(0, 6), _rows(4, 8)],
        lambda f: ((10, 2), (4, 0), (2, 2)),
        exc=CheckpointMismatchError,
        match="layouts overlap",
    )
    assert check("plan_scatter", "leaf", [_rows(0, 6), _rows(4, 8)], lambda f: ((10, 2), (0, 0), (3, 2)))[0] == "ok"
    assert check("plan_scatter", "leaf", [_rows(0, 6), _rows(6, 10)], lambda f: whole)[0] == "ok"


def test_a_gap_is_named_a_missing_buffer_and_a_0d_replica_is_planned_once() -> None:
    """Rows [0,4) and [6,10) of a 10x2 state: a gap, named as such (an overlap is refused before the
    element count, with its own message, so the count's message does not offer one). A 0-d state that
    two layout tables list (replicas) is one box: planned once, no overlap."""
    whole = ((10, 2), (0, 0), (10, 2))
    message = check_error(
        "plan_scatter", "leaf", [_rows(0, 4), _rows(6, 10)], lambda f: whole, exc=CheckpointMismatchError
    )
    assert message == (
        "leaf 'leaf': state 'exp_avg' of 'p': the checkpoint's buffers cover 16 of the 20 elements of "
        "this rank's chunk (a buffer or layout table is missing from the checkpoint)"
    ), message
    scalar = P.encode_layout("leaf", [("p", "step", "float32", 4, (), (), ())], 1 << 20)[0]
    targets, sources, ops = check("plan_scatter", "leaf", [scalar, scalar], lambda f: ((), (), ()))[1]
    assert [t[:2] for t in targets] == [("p", "step")] and len(sources) == 1 and len(ops) == 1


def test_a_bucket_past_int64_is_refused_alike() -> None:
    """encode_layout: Python raised a raw struct.error, C++ wrapped the count; now one error."""
    big = 2**62
    ents = [(f, "k", "float32", 4, (big,), (0,), (big,)) for f in ("a", "b", "c", "d", "e")]
    check_error(
        "encode_layout",
        "leaf",
        ents,
        2**100,
        exc=CheckpointFormatError,
        match="leaf 'leaf': state 'k' of 'b': its float32 bucket would hold 9223372036854775808 elements",
    )
    huge = [(f, "k", "float32", 4, (2**63 - 1,), (0,), (2**63 - 1,)) for f in ("x", "y", "z")]  # past 2**64 too
    check_error(
        "encode_layout",
        "leaf",
        huge,
        2**100,
        exc=CheckpointFormatError,
        match="leaf 'leaf': state 'k' of 'y': its float32 bucket would hold 18446744073709551614 elements",
    )


def test_a_bucket_count_past_int64_is_refused_alike() -> None:
    """plan_scatter/decode_layout: a bucket of 2**64-2 elements (two chunks of 2**63-1) gave an
    element offset of 18446744073709551614 in Python and -2 in C++."""
    n = 2**63 - 1
    raw = bytearray(P.encode_layout("leaf", [("a", "k", "float32", 4, (n,), (0,), (n,))], 2**100)[0])
    one = raw[10 + 4 + len("float32") + 8 + 4 :]  # the entry
    table = (
        bytes(raw[:10])
        + (7).to_bytes(4, "little")
        + b"float32"
        + (2 * n).to_bytes(8, "little")
        + (2).to_bytes(4, "little")
    )
    table += bytes(one) + bytes(one).replace(b"\x01\x00\x00\x00a", b"\x01\x00\x00\x00b", 1)
    for name, args in (
        ("decode_layout", ("leaf", table)),
        ("plan_scatter", ("leaf", [table], lambda f: ((n,), (0,), (n,)))),
    ):
        check_error(
            name, *args, exc=CheckpointFormatError, match="bucket of 18446744073709551614 elements (at most 2**63-1)"
        )


def _dim_fields(table: bytes) -> list[int]:
    """Byte offsets of every i64 dimension field (shape, offsets, sizes) of a layout table."""
    out = []
    pos = 6
    n_buckets = int.from_bytes(table[pos : pos + 4], "little")
    pos += 4
    for _ in range(n_buckets):
        pos += 4 + int.from_bytes(table[pos : pos + 4], "little") + 8  # dtype, numel
        n_entries = int.from_bytes(table[pos : pos + 4], "little")
        pos += 4
        for _ in range(n_entries):
            for _s in range(2):  # fqn, key
                pos += 4 + int.from_bytes(table[pos : pos + 4], "little")
            ndim = int.from_bytes(table[pos : pos + 4], "little")
            pos += 4
            out.extend(range(pos, pos + 24 * ndim, 8))
            pos += 24 * ndim
    return out


def _ground_truth(shape: tuple[int, ...]) -> dict[tuple[str, str], torch.Tensor]:
    return {
        (f, k): torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) * (1 + i) + 0.5
        for i, (f, k) in enumerate((f, k) for f in ("p", "q") for k in ("exp_avg", "exp_avg_sq"))
    }


@PROPS
@given(st.data())
def test_mutated_layouts_are_never_accepted_wrong(data: st.DataObject) -> None:
    """Byte mutations of one of several saving ranks' layout tables: both cores agree, and a plan
    they accept, run on the buffers as saved (a buffer whose dtype or length the plan does not
    expect is refused by the library), fills every target of a saved (FQN, key) exactly."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    shape = (rng.randint(2, 6), 2)
    layouts = _shard_layouts(shape, rng.randint(1, 3), rng)
    truth = _ground_truth(shape)
    saved: dict[tuple[int, int], tuple[str, int, torch.Tensor]] = {}
    for li, table in enumerate(layouts):
        for bi, (dtype, numel, entries) in enumerate(P.decode_layout("leaf", table)):
            parts = [
                truth[(f, k)][tuple(slice(o, o + s) for o, s in zip(offs, sizes))].reshape(-1)
                for f, k, _shape, offs, sizes in entries
            ]
            saved[(li, bi)] = (dtype, numel, torch.cat(parts) if parts else torch.empty(0))
    victim = data.draw(st.integers(0, len(layouts) - 1))
    table = layouts[victim]
    if data.draw(st.booleans()):  # a flipped byte anywhere
        at = data.draw(st.integers(6, len(table) - 1))
        bad = table[:at] + bytes([table[at] ^ data.draw(st.integers(1, 255))]) + table[at + 1 :]
    else:  # one dimension field (shape, offset or size) set to a small value: the edits that keep counts
        at = data.draw(st.sampled_from(_dim_fields(table)))
        value = data.draw(st.integers(-1, shape[0] + 1))
        bad = table[:at] + value.to_bytes(8, "little", signed=True) + table[at + 8 :]
    mutated = [*layouts[:victim], bad, *layouts[victim + 1 :]]
    lo = rng.randint(0, shape[0] - 1)
    mine = {"p": (shape, (lo, 0), (shape[0] - lo, 2)), "q": (shape, (0, 0), shape)}
    res = check("plan_scatter", "leaf", mutated, lambda f: mine.get(f))
    if res[0] == "err":
        assert res[1] in (CheckpointFormatError, CheckpointMismatchError), res
        return
    targets, sources, ops = res[1]
    for li, bi, dtype, numel in sources:
        if (li, bi) not in saved or saved[(li, bi)][:2] != (dtype, numel):
            return  # the library refuses a buffer of another dtype or length (buffers._check_buffer)
    out = [torch.full(t[5], float("nan")) for t in targets]
    for si, src_off, src_sizes, src_start, ti, dst_start, box in ops:
        li, bi, _d, _n = sources[si]
        src = saved[(li, bi)][2][src_off : src_off + math.prod(src_sizes)].view(src_sizes)
        src = src[tuple(slice(a, a + b) for a, b in zip(src_start, box))]
        out[ti][tuple(slice(a, a + b) for a, b in zip(dst_start, box))] = src
    for (fqn, key, dtype, tshape, offs, sizes), got in zip(targets, out):
        if (fqn, key) not in truth:
            continue  # a renamed entry: not a state this checkpoint recorded (its ~keys refuse the load)
        assert dtype == "float32" and tshape == shape, (fqn, key, dtype, tshape)
        want = truth[(fqn, key)][tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
        assert torch.equal(got, want), f"accepted but wrong: {fqn} {key} at byte {at}"


# --------------------------------------------------------------------------- many tables per target


@st.composite
def _many_tables(draw: st.DrawFn) -> tuple[list[bytes], dict[str, Any]]:
    """Up to 12 layout tables, each with one chunk of every (FQN, key) it lists, so that a target
    can meet many placements: pieces of dim 0 that tile it (tables past the pieces' count repeat
    them: replicas), or random chunks (overlaps, gaps); sometimes another dtype or shape in one
    table. And a random answer of ``chunk_of`` per FQN (a chunk with offsets, the whole parameter,
    ``None``, or another shape)."""
    shape = draw(st.sampled_from([(12, 3), (5,), (4, 2, 2), ()]))
    names = [("p", "exp_avg"), ("p", "exp_avg_sq"), ("é.w", "exp_avg"), ("q", "m.x")]
    n_tables = draw(st.integers(1, 12))
    tile = bool(shape) and draw(st.booleans())
    cuts = sorted(set(draw(st.lists(st.integers(0, shape[0]), max_size=11)))) if shape else []
    pieces = list(zip([0, *cuts], [*cuts, shape[0]])) if shape else []
    odd = draw(st.integers(-2 * n_tables, n_tables - 1))  # a table with another dtype or shape, when >= 0
    tables: list[bytes] = []
    for ti in range(n_tables):
        ents = []
        for fqn, key in names if tile else draw(st.lists(st.sampled_from(names), unique=True, min_size=1)):
            if tile:
                lo, hi = pieces[ti % len(pieces)]
                offsets, sizes = (lo, *(0 for _ in shape[1:])), (hi - lo, *shape[1:])
            else:
                los = [draw(st.integers(0, d)) for d in shape]
                offsets = tuple(los)
                sizes = tuple(d - o if draw(st.booleans()) else draw(st.integers(0, d - o)) for d, o in zip(shape, los))
            tshape, dtype = shape, "float32"
            if ti == odd and draw(st.booleans()):
                tshape, offsets, sizes = (*shape, 1), (*offsets, 0), (*sizes, 1)
            elif ti == odd:
                dtype = "bfloat16"
            ents.append((fqn, key, dtype, DTYPES[dtype], tshape, offsets, sizes))
        tables.append(P.encode_layout("leaf", ents, draw(st.sampled_from([8, 1 << 20])))[0])
    mine: dict[str, Any] = {}
    for fqn in ("p", "é.w", "q"):
        kind = draw(st.sampled_from(["whole", "whole", "part", "part", "none", "other"]))
        if kind == "whole":
            mine[fqn] = (shape, (0,) * len(shape), shape)
        elif kind == "part":
            lo = tuple(draw(st.integers(0, d)) for d in shape)
            mine[fqn] = (shape, lo, tuple(draw(st.integers(0, d - o)) for d, o in zip(shape, lo)))
        elif kind == "other":
            mine[fqn] = ((*shape, 2), (0,) * (len(shape) + 1), (*shape, 2))
    return tables, mine


@PROPS
@given(_many_tables())
def test_plans_of_many_tables_agree(case: tuple[list[bytes], dict[str, Any]]) -> None:
    """Targets that many tables place (past the few placements and boxes the C++ core keeps inline,
    past the count where it keeps them in a hash set): both cores give the same plan or error."""
    tables, mine = case
    res = check("plan_scatter", "leaf", tables, lambda f: mine.get(f))
    assert res[0] == "ok" or res[1] in (CheckpointFormatError, CheckpointMismatchError), res


def test_plans_of_many_replicas_and_pieces() -> None:
    """Twelve row pieces of one state, each saved by two ranks (24 placements, 12 boxes), with and
    without one piece missing or doubled: planned as the twin plans it."""
    rows = [
        P.encode_layout("leaf", [("p", "exp_avg", "float32", 4, (12, 2), (r, 0), (1, 2))], 64)[0] for r in range(12)
    ]
    whole = ((12, 2), (0, 0), (12, 2))
    targets, sources, ops = check("plan_scatter", "leaf", [*rows, *rows[::-1]], lambda f: whole)[1]
    assert len(targets) == 1 and len(ops) == 12 and len(sources) == 12
    check_error(
        "plan_scatter",
        "leaf",
        [*rows[:5], *rows[6:]],
        lambda f: whole,
        exc=CheckpointMismatchError,
        match="cover 22 of the 24 elements",
    )
    doubled = P.encode_layout("leaf", [("p", "exp_avg", "float32", 4, (12, 2), (3, 0), (2, 2))], 64)[0]
    check_error(
        "plan_scatter",
        "leaf",
        [*rows, doubled],
        lambda f: whole,
        exc=CheckpointMismatchError,
        match="chunks at offsets (3, 0) of sizes (1, 2) and at offsets (3, 0) of sizes (2, 2)",
    )


def test_plan_survives_chunk_of_dropping_tables() -> None:
    """``chunk_of`` that deletes the tables already read from the list (their only reference): the
    C++ core keeps them alive for its indexes; both cores give the same plan."""

    def fresh() -> tuple:
        layouts = [
            bytes(P.encode_layout("leaf", [(f, "exp_avg", "float32", 4, (2,), (0,), (2,))], 64)[0])
            for f in ("a", "b", "c")
        ]

        def chunk_of(fqn: str) -> Any:
            if fqn == "b":
                del layouts[0]
            return ((2,), (0,), (2,))

        return "leaf", layouts, chunk_of

    res = check("plan_scatter", fresh=fresh)
    assert res[0] == "ok" and [t[0] for t in res[1][0]] == ["a", "b"]
