"""`sparse_ckpt._format.layout_index.decode_index`, split into named steps (header, rank tags, meshes,
descriptions), decodes and refuses every input as the single function it replaced did: the same
index, or the same `CheckpointFormatError` with the same message. The replaced decoder is kept here,
unchanged, as the reference; the inputs are real indexes, those damaged, and random headers and
descriptions."""

from __future__ import annotations

import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_ckpt._format.codec import decode_table, encode_table
from sparse_ckpt._format.keys import parse_rank_tag
from sparse_ckpt._format.layout_index import (
    HEADER,
    INDEX_VERSION,
    MAX_NDIM,
    REPLICATE,
    LayoutIndex,
    _ints,
    _tags_of,
    build_index,
    decode_index,
)
from sparse_ckpt.errors import CheckpointFormatError

LEAF = "optim"


def reference_decode_index(leaf: str, key: str, data: bytes) -> LayoutIndex:  # noqa: C901 -- the replaced code, kept whole
    """Index item ``key``'s (unsealed) bytes, decoded and checked: a :class:`CheckpointFormatError`
    naming leaf and key for any defect (the table codec's own checks, then the index's: version,
    rank tags of one world, meshes of distinct saved ranks each holding a layout, descriptions in
    range, an FQN listed once)."""

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"leaf {leaf!r}: layout index {key!r}: {what} (a damaged or edited checkpoint)")

    settings, _blobs, groups = decode_table(leaf, data)
    if not groups or groups[0][1] or settings[groups[0][0]].get(HEADER, None) is None:
        raise bad("no header")
    header = settings[groups[0][0]]
    if type(header[HEADER]) is not int or header[HEADER] != INDEX_VERSION:
        raise bad(f"unsupported version {header[HEADER]!r} (this library reads version {INDEX_VERSION})")
    if set(header) != {HEADER, "tags", "meshes"}:
        raise bad(f"header keys {sorted(header)}")
    tags = header["tags"]
    if type(tags) is not tuple or not tags or not all(type(t) is str for t in tags):
        raise bad("tags are not a non-empty tuple of str")
    runs: list[list[tuple[int, int, int]]] = []
    world = None
    for tag in tags:
        try:
            parsed = parse_rank_tag(tag)
        except CheckpointFormatError:
            parsed = None
        if parsed is None or (world is not None and parsed[0] != world):
            raise bad(f"tag {tag!r} is not a rank tag of the others' world")
        world = parsed[0]
        runs.append(parsed[1])
    meshes = header["meshes"]
    if type(meshes) is not tuple:
        raise bad("meshes are not a tuple")
    checked_meshes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for mesh in meshes:
        if type(mesh) is not tuple or len(mesh) != 2 or not all(_ints(x) for x in mesh):
            raise bad("a mesh is not (shape, ranks)")
        shape, ranks = mesh
        if not shape or len(shape) > MAX_NDIM or any(d < 1 for d in shape) or math.prod(shape) != len(ranks):
            raise bad(f"mesh of shape {shape} lists {len(ranks)} ranks")
        if len(set(ranks)) != len(ranks):
            raise bad(f"mesh {shape} lists a rank twice")
        checked_meshes.append((shape, ranks))
    rank_tag = _tags_of({r for _shape, ranks in checked_meshes for r in ranks}, runs)
    missing = [r for _shape, ranks in checked_meshes for r in ranks if r not in rank_tag]
    if missing:
        raise bad(f"mesh rank {missing[0]} holds none of the index's layout tags")
    out = LayoutIndex(leaf, key, tags, rank_tag)
    for idx, fqns in groups[1:]:
        desc = settings[idx]
        if set(desc) == {"shape", "mesh", "placements"}:
            shape, mi, placements = desc["shape"], desc["mesh"], desc["placements"]
            if not _ints(shape) or len(shape) > MAX_NDIM or any(d < 0 for d in shape):
                raise bad(f"description {idx}: shape {shape!r}")
            if type(mi) is not int or not 0 <= mi < len(checked_meshes):
                raise bad(f"description {idx}: mesh {mi!r} out of range")
            mesh_shape, mesh_ranks = checked_meshes[mi]
            if (
                not _ints(placements)
                or len(placements) != len(mesh_shape)
                or any(not REPLICATE <= p < len(shape) for p in placements)
            ):
                raise bad(
                    f"description {idx}: placements {placements!r} for a {len(shape)}-d tensor on a "
                    f"{len(mesh_shape)}-d mesh"
                )
            value: tuple[str, Any] = ("spec", (shape, mesh_shape, mesh_ranks, placements))
        elif len(desc) == 1 and next(iter(desc)) in ("whole", "chunks"):
            kind = next(iter(desc))
            ts = desc[kind]
            if not _ints(ts) or not ts or any(not 0 <= t < len(tags) for t in ts):
                raise bad(f"description {idx}: {kind} tags {ts!r}")
            value = (kind, tuple(ts))
        else:
            raise bad(f"description {idx} has keys {sorted(desc)}")
        for fqn in fqns:
            if fqn in out.of:
                raise bad(f"parameter {fqn!r} is listed twice")
            out.of[fqn] = value
    return out


def _outcome(decode: Any, data: bytes) -> tuple[Any, ...]:
    try:
        index = decode(LEAF, "k", data)
    except CheckpointFormatError as exc:
        return ("refused", type(exc), str(exc))
    return ("index", index.leaf, index.key, index.tags, index.rank_tag, index.of)


def _same(data: bytes) -> tuple[Any, ...]:
    out = _outcome(decode_index, data)
    assert out == _outcome(reference_decode_index, data)
    return out


SPEC = ((8, 4), (4,), (0, 1, 2, 3), (0,))
HSDP = ((4,), (2, 2), (0, 1, 2, 3), (REPLICATE, 0))


def _good() -> list[bytes]:
    return [
        build_index(LEAF, [(f"w4r{r}", (((SPEC, ("w",)),), (f"e{r}",), ())) for r in range(4)]),
        build_index(LEAF, [(f"w4r{r}", (((HSDP, ("h",)),), ("x",) if r == 3 else (), ())) for r in range(4)]),
        build_index(
            LEAF,
            [
                ("w4r0", (((SPEC, ("a", "b")),), (), ())),
                ("w4r1", (((SPEC, ("a",)),), ("b",), ())),
                ("w4r2", (((SPEC, ("a", "b")),), (), ())),
                ("w4r3", (((SPEC, ("a", "b")),), (), ("c",))),
            ],
        ),
    ]


GOOD = _good()


def test_real_and_damaged_indexes_decode_the_same() -> None:
    for data in GOOD:
        assert _same(data)[0] == "index"
    rng = random.Random(0)
    kinds = set()
    for good in GOOD:
        for n in range(0, len(good), 5):
            kinds.add(_same(good[:n])[0])
        for _ in range(300):
            b = bytearray(good)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            kinds.add(_same(bytes(b))[0])
    assert kinds == {"index", "refused"}


_INTS = st.lists(st.integers(-2, 5), max_size=3).map(tuple)
_VALUE = st.one_of(st.integers(-2, 5), st.text(max_size=3), _INTS, st.none(), st.booleans())


def _mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` nine times in ten (so that most inputs reach the later checks), else ``bad``."""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 9 else good)


_TAG = _mostly(
    st.sampled_from(["w4r0", "w4r1", "w4r2-3", "w4r0-3", "w4r1-3:2"]),
    st.sampled_from(["w2r0", "x", "w1000000000000000r0-999999999999999"]),
)
_MESH = _mostly(
    st.sampled_from([((4,), (0, 1, 2, 3)), ((2, 2), (0, 1, 2, 3)), ((2,), (1, 3)), ((1,), (2,))]),
    st.sampled_from([((2,), (0, 0)), ((3,), (0, 1)), ((2,), (0, 9)), ((), ()), ((0,), ()), ((2,),)]) | _VALUE,
)


@st.composite
def _header(draw: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        HEADER: draw(_mostly(st.just(INDEX_VERSION), st.sampled_from([INDEX_VERSION + 1, "1", True]))),
        "tags": draw(_mostly(st.lists(_TAG, min_size=1, max_size=3).map(tuple), _VALUE)),
        "meshes": draw(_mostly(st.lists(_MESH, max_size=2).map(tuple), _VALUE)),
    }
    if draw(st.integers(0, 19)) == 19:
        header["extra"] = 1
    if draw(st.integers(0, 19)) == 19:
        del header["meshes"]
    return header


@st.composite
def _description(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["spec", "spec", "whole", "chunks", "other"]))
    if kind == "spec":
        desc = {
            "shape": draw(_mostly(st.lists(st.integers(0, 8), max_size=2).map(tuple), _VALUE)),
            "mesh": draw(_mostly(st.integers(0, 1), st.integers(-1, 2) | _VALUE)),
            "placements": draw(_mostly(st.lists(st.integers(-1, 1), min_size=1, max_size=2).map(tuple), _VALUE)),
        }
        if draw(st.integers(0, 19)) == 19:
            desc["extra"] = 0
        return desc
    if kind == "other":
        return {draw(st.sampled_from(["shape", "x", "whole"])): 0, "y": 1}
    return {kind: draw(_mostly(st.lists(st.integers(0, 2), min_size=1, max_size=2).map(tuple), _VALUE))}


@settings(max_examples=800, deadline=None)
@given(
    header=_header(),
    descriptions=st.lists(
        st.tuples(_description(), st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=2, unique=True)),
        max_size=3,
    ),
    header_fqns=_mostly(st.just([]), st.just(["a"])),
)
def test_random_headers_and_descriptions_decode_the_same(
    header: dict[str, Any], descriptions: list[tuple[dict[str, Any], list[str]]], header_fqns: list[str]
) -> None:
    _same(encode_table(LEAF, [(header, header_fqns), *descriptions]))
