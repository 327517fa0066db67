"""The layout index of ``state_layout="buffers"`` (docs/formats.md, *Layout index*), in one process:

* its chunk arithmetic is torch's ``Shard`` chunking (``torch.chunk``, nested mesh dim by mesh dim),
  and the saved ranks it finds for a box are exactly those whose chunks overlap it;
* it round-trips, and a decoder fed damaged or hostile bytes raises only `CheckpointFormatError`
  (cheaply: a tag claiming a huge world costs nothing);
* a load reads only the layout tables it points to, and refuses an index that points elsewhere
  than the tables holding the state, naming leaf, FQN, key and the index;
* a single process writes none (nothing to reshard from).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import sparse_ckpt as sc
from sparse_ckpt import _backend
from sparse_ckpt._format.keys import BUFFERS_PREFIX, seal
from sparse_ckpt._format.layout_index import (
    REPLICATE,
    build_index,
    check_index,
    chunk_at,
    decode_index,
    shard_ranges,
)
from sparse_ckpt._fqn import FqnMap
from sparse_ckpt._layouts.bucketed_load import BucketReader, expand

LEAF = "optim"


def _torch_chunks(size: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the ``n`` chunks torch's ``Shard`` gives a dim of ``size``: ``torch.chunk``'s
    pieces, then empty ones (``torch.chunk`` returns fewer pieces than asked when they run out)."""
    pieces = torch.arange(size).chunk(n) if size else ()
    out = [(int(p[0]), int(p[-1]) + 1) for p in pieces if p.numel()]
    return out + [(size, size)] * (n - len(out))


def _reference_chunk(
    shape: tuple[int, ...], mesh: tuple[int, ...], codes: tuple[int, ...], coord: tuple[int, ...]
) -> Any:
    lo, hi = [0] * len(shape), list(shape)
    for m, code in enumerate(codes):
        if code != REPLICATE:
            a, b = _torch_chunks(hi[code] - lo[code], mesh[m])[coord[m]]
            lo[code], hi[code] = lo[code] + a, lo[code] + b
    return tuple(lo), tuple(h - low for low, h in zip(lo, hi))


@st.composite
def _specs(draw: Any) -> Any:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    codes = tuple(draw(st.sampled_from([REPLICATE, *range(len(shape))])) for _ in mesh)
    offsets = tuple(draw(st.integers(0, d)) for d in shape)
    sizes = tuple(draw(st.integers(0, d - o)) for d, o in zip(shape, offsets))
    return (shape, mesh, tuple(range(math.prod(mesh))), codes), offsets, sizes


@settings(max_examples=300, deadline=None)
@given(_specs())
def test_chunks_and_overlaps_are_torchs(case: Any) -> None:
    spec, offsets, sizes = case
    shape, mesh, _ranks, codes = spec
    sharding = [m for m, code in enumerate(codes) if code != REPLICATE]
    overlapping = set()
    for coord in itertools.product(*map(range, mesh)):
        want = _reference_chunk(shape, mesh, codes, coord)
        got = chunk_at(spec, coord)
        assert got[1] == want[1] and (0 in want[1] or got[0] == want[0]), (spec, coord, got, want)
        if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(want[0], want[1], offsets, sizes)):
            overlapping.add(tuple(coord[m] for m in sharding))
    found = [tuple(c[m] for m in sharding) for c in shard_ranges(spec, offsets, sizes)]
    assert sorted(found) == sorted(overlapping)  # each once


def _index(tags_parts: list[tuple[str, Any]]) -> bytes:
    return build_index(LEAF, tags_parts)


SPEC = ((8, 4), (4,), (0, 1, 2, 3), (0,))
"""8 rows sharded over 4 ranks: 2 each."""


def test_round_trip_and_selection() -> None:
    parts = [(f"w4r{r}", (((SPEC, ("w",)),), (f"e{r}",), ())) for r in range(4)]
    index = decode_index(LEAF, "k", _index(parts))
    assert index.tags == ("w4r0", "w4r1", "w4r2", "w4r3")
    assert index.of == {"w": ("spec", SPEC), **{f"e{r}": ("whole", (r,)) for r in range(4)}}
    # rows 0-3 of 8 on a 2-rank load: saved ranks 0 and 1; experts 1 and 2 are whole in ranks 1, 2
    assert index.tags_for(
        [("w", ((8, 4), (0, 0), (4, 4))), ("e1", ((1,), (0,), (1,))), ("e2", ((1,), (0,), (1,)))]
    ) == {"w4r0", "w4r1", "w4r2"}
    assert index.tags_for([("w", ((8, 4), (0, 0), (0, 4)))]) == {"w4r0"}  # an empty chunk: one table, for its keys
    assert index.tags_for([("other", ((1,), (0,), (1,)))]) == set()


def test_parts_that_disagree_are_read_in_full() -> None:
    """A rank of the mesh without the parameter, or a parameter sharded on one rank and whole on
    another: listed as ``chunks`` of every tag holding it (all of them read)."""
    parts = [
        ("w4r0", (((SPEC, ("a", "b")),), (), ())),
        ("w4r1", (((SPEC, ("a",)),), ("b",), ())),
        ("w4r2", (((SPEC, ("a", "b")),), (), ())),
        ("w4r3", (((SPEC, ("a", "b")),), (), ("c",))),
    ]
    index = decode_index(LEAF, "k", _index(parts))
    assert index.of["a"] == ("spec", SPEC)
    assert index.of["b"] == ("chunks", (0, 1, 2, 3))
    assert index.of["c"] == ("chunks", (3,))
    assert index.tags_for([("b", ((8, 4), (0, 0), (1, 4)))]) == {"w4r0", "w4r1", "w4r2", "w4r3"}


def test_replicas_share_a_table() -> None:
    """HSDP (2 replicas x 2 shards): a chunk any replica holds is read once, from a table already chosen."""
    spec = ((4,), (2, 2), (0, 1, 2, 3), (REPLICATE, 0))
    parts = [(f"w4r{r}", (((spec, ("h",)),), ("x",) if r == 3 else (), ())) for r in range(4)]
    index = decode_index(LEAF, "k", _index(parts))
    # rows 0-3: shard 0 (ranks 0, 2) and shard 1 (ranks 1, 3); "x" forces rank 3, which also serves shard 1
    assert index.tags_for([("x", ((1,), (0,), (1,))), ("h", ((4,), (0,), (4,)))]) == {"w4r0", "w4r3"}


def _damaged_cases() -> list[bytes]:
    parts = [(f"w4r{r}", (((SPEC, ("w",)),), (f"e{r}",), ())) for r in range(4)]
    good = _index(parts)
    rng = random.Random(0)
    cases = [good[:n] for n in range(0, len(good), 7)]
    for _ in range(300):
        b = bytearray(good)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        cases.append(bytes(b))
    return cases


def test_damaged_indexes_are_refused_by_name() -> None:
    for data in _damaged_cases():
        try:
            decode_index(LEAF, "state.__buffers__.optim.Iw4r0-3", data)
        except sc.CheckpointFormatError:
            continue


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"~index": 2, "tags": ("w2r0",), "meshes": ()}, "unsupported version 2"),
        ({"~index": 1, "tags": ("w2r0", "w3r1"), "meshes": ()}, "not a rank tag of the others' world"),
        ({"~index": 1, "tags": ("w2r0",), "meshes": (((2,), (0, 1)),)}, "mesh rank 1 holds none"),
        ({"~index": 1, "tags": ("w2r0",), "meshes": (((3,), (0, 1)),)}, "lists 2 ranks"),
        # a tag claiming 10**15 ranks: decoded without listing them
        ({"~index": 1, "tags": ("w1000000000000000r0-999999999999999",), "meshes": (((2,), (0, 5)),)}, None),
    ],
)
def test_hostile_headers(header: dict[str, Any], match: str | None) -> None:
    from sparse_ckpt._format.codec import encode_table

    data = encode_table(LEAF, [(header, [])])
    if match is None:
        assert decode_index(LEAF, "k", data).rank_tag == {0: 0, 5: 0}
    else:
        with pytest.raises(sc.CheckpointFormatError, match=f"layout index 'k': .*{match}"):
            decode_index(LEAF, "k", data)


def _layouts() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two saved ranks, each holding one whole parameter's ``exp_avg``: layouts, buffers."""
    core = _backend.core
    store: dict[str, Any] = {}
    for rank, fqn in enumerate(("a", "b")):
        table, _buckets = core.encode_layout(LEAF, [(fqn, "exp_avg", "float32", 4, (3,), (0,), (3,))], 1 << 20)
        store[f"{BUFFERS_PREFIX}{LEAF}.Lw2r{rank}"] = seal(table)
        store[f"{BUFFERS_PREFIX}{LEAF}.B0_float32_w2r{rank}"] = torch.full((3,), float(rank + 1))
    return store, {}


def _expand(store: dict[str, Any], index: bytes, fqns: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    store = {**store, f"{BUFFERS_PREFIX}{LEAF}.Iw2r0-1": seal(index)}
    read: list[str] = []

    def read_items(keys: list[str], consume: Any) -> None:
        read.extend(keys)
        for key in keys:
            consume(key, store[key])

    reader = BucketReader({k: k for k in store}, read_items)
    fmap = FqnMap(canonical={f: f for f in fqns}, param_of={f: torch.zeros(3) for f in fqns})

    def expected(leaf: str, found: set[tuple[str, str]]) -> bool:
        return any((f, "exp_avg") not in found for f in fqns)

    return expand([], {}, fmap, reader, expected), read


def test_a_load_reads_only_the_tables_the_index_points_to() -> None:
    store, _ = _layouts()
    index = _index([("w2r0", ((), ("a",), ())), ("w2r1", ((), ("b",), ()))])
    out, read = _expand(store, index, ("b",))
    assert torch.equal(out["b"]["exp_avg"], torch.full((3,), 2.0))
    assert sorted(k.rpartition(".")[2] for k in read) == ["B0_float32_w2r1", "Iw2r0-1", "Lw2r1"]


def test_an_index_pointing_elsewhere_is_refused() -> None:
    store, _ = _layouts()
    index = _index([("w2r0", ((), ("b",), ())), ("w2r1", ((), ("a",), ()))])  # a and b swapped
    with pytest.raises(
        sc.CheckpointFormatError,
        match=r"state 'exp_avg' of 'b' is in layout table 'state.__buffers__.optim.Lw2r1', which the leaf's layout "
        r"index 'state.__buffers__.optim.Iw2r0-1' does not point to",
    ):
        _expand(store, index, ("b",))


def test_verify_checks_an_index_against_the_layouts() -> None:
    """What ``verify`` checks (``check_index``): every chunk of every layout is where the index says."""
    spec = ((4,), (2,), (0, 1), (0,))
    tables = {
        "w2r0": [("s", "exp_avg", (4,), (0,), (2,)), ("e0", "exp_avg", (3,), (0,), (3,))],
        "w2r1": [("s", "exp_avg", (4,), (2,), (2,)), ("e1", "exp_avg", (3,), (0,), (3,))],
    }
    good = [("w2r0", (((spec, ("s",)),), ("e0",), ())), ("w2r1", (((spec, ("s",)),), ("e1",), ()))]
    check_index(decode_index(LEAF, "k", _index(good)), tables)
    wrong = [
        [("w2r0", (((spec, ("s",)),), ("e1",), ())), ("w2r1", (((spec, ("s",)),), ("e0",), ()))],  # experts swapped
        [
            ("w2r0", (((spec, ("s",)),), ("e0", "e1"), ())),
            ("w2r1", (((spec, ("s",)),), (), ())),
        ],  # a tag not listing e1
    ]
    for parts in wrong:
        with pytest.raises(
            sc.CheckpointFormatError, match=r"state 'exp_avg' of 'e.' in layout tag 'w2r.' is not where"
        ):
            check_index(decode_index(LEAF, "k", _index(parts)), tables)
    shifted = {**tables, "w2r1": [("s", "exp_avg", (4,), (1,), (2,)), *tables["w2r1"][1:]]}  # not torch's chunk
    with pytest.raises(sc.CheckpointFormatError, match="state 'exp_avg' of 's' in layout tag 'w2r1'"):
        check_index(decode_index(LEAF, "k", _index(good)), shifted)


def test_one_process_writes_no_index() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sd = sc.sparse_state_dict(model, opt, state_layout="buffers")
    assert [k for k in sd if k.startswith(BUFFERS_PREFIX)] == [
        f"{BUFFERS_PREFIX}optim.Lw1r0",
        f"{BUFFERS_PREFIX}optim.B0_float32_w1r0",
    ]
