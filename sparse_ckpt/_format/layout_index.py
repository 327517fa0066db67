"""The *layout index* of a ``state_layout="buffers"`` leaf (docs/formats.md, *Layout index*): which
saved layout tables hold the chunks of each state tensor, described per tensor, not per chunk.

A coordinated save of several ranks writes, per leaf, one index that every rank holding a layout
of the leaf writes with the same bytes (so DCP stores it once): the leaf's layout tags, the device
meshes its DTensor parameters were sharded over, and per parameter either its *sharding
description* (global shape, mesh, ``Shard``/``Replicate`` placements: which saved rank holds which
chunk follows from torch's chunking, computed here by arithmetic, :func:`shard_ranges`) or the
layout tags that hold it whole (plain tensors: expert parallelism, single-rank tensors) or in
chunks the description cannot say (``chunks``: read all of them). A load that resharding makes
read other ranks' layouts reads the index and then only the tables whose chunks overlap what it
needs (:meth:`LayoutIndex.tags_for`).

:func:`build_index` merges the ranks' :data:`IndexPart` s (:mod:`sparse_ckpt._layouts.bucketed_index`
makes them) into the index bytes (a table-codec table); :func:`decode_index` reads and checks one
(hostile input: every defect a :class:`CheckpointFormatError`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice, product
from typing import Any

from ..errors import CheckpointFormatError
from .codec import decode_table, encode_table
from .keys import parse_rank_tag

__all__ = [
    "INDEX_VERSION",
    "REPLICATE",
    "IndexPart",
    "LayoutIndex",
    "Spec",
    "build_index",
    "check_index",
    "chunk_at",
    "decode_index",
    "same_chunk",
    "shard_ranges",
]

INDEX_VERSION = 1
HEADER = "~index"
"""The header settings entry's version key (no description has it)."""
REPLICATE = -1
"""A placement code: ``Replicate()``; a code ``d >= 0`` is ``Shard(d)``."""
MAX_NDIM = 64
MAX_REPLICAS = 64
"""Replicas of a chunk considered when choosing which table to read it from (the work per chunk
stays bounded whatever the mesh; a chunk of a larger replica group comes from one of its first)."""

Spec = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""A sharding description: ``(global shape, mesh shape, mesh ranks row-major, placement codes)``."""

IndexPart = tuple[tuple[tuple[Spec, tuple[str, ...]], ...], tuple[str, ...], tuple[str, ...]]
"""One rank's contribution to a leaf's index: ``(((spec, fqns), ...), whole fqns, chunked fqns)``:
the FQNs of its layout whose chunk is the one ``spec`` gives its mesh coordinate, the FQNs it
holds whole (plain tensors), and the FQNs it holds in another chunk (the index cannot describe them)."""


# --------------------------------------------------------------------------- torch's chunking


def _split(size: int, n: int, c: int) -> tuple[int, int]:
    """``(start, stop)`` of chunk ``c`` of ``n`` of a dimension of ``size``: torch's ``Shard``
    (``torch.chunk``: chunks of ``ceil(size / n)``, the last ones smaller or empty)."""
    step = -(-size // n)
    start = min(step * c, size)
    return start, max(start, min(size, step * c + step))


def chunk_at(spec: Spec, coord: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the chunk the rank at mesh coordinate ``coord`` holds (shards applied
    mesh dim by mesh dim, left to right, as torch's ``_compute_local_shape_and_global_offset``)."""
    shape, _mesh, _ranks, placements = spec
    lo, hi = [0] * len(shape), list(shape)
    for mesh_dim, code in enumerate(placements):
        if code == REPLICATE:
            continue
        start, stop = _split(hi[code] - lo[code], _mesh[mesh_dim], coord[mesh_dim])
        lo[code], hi[code] = lo[code] + start, lo[code] + stop
    return tuple(lo), tuple(h - low for low, h in zip(lo, hi))


def shard_ranges(spec: Spec, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[dict[int, int]]:
    """The mesh coordinates (``{mesh dim: coordinate}`` over the sharding mesh dims) whose chunks
    share an element with the box ``offsets``/``sizes``, found by arithmetic (work in proportion to
    the answer, not to the mesh); Replicate mesh dims are left out (any coordinate holds the same)."""
    shape, mesh, _ranks, placements = spec
    per_dim: list[list[dict[int, int]]] = []
    for d in range(len(shape)):
        dims = [m for m, code in enumerate(placements) if code == d]
        lo, hi = offsets[d], offsets[d] + sizes[d]
        found: list[dict[int, int]] = []
        if lo < hi:
            _overlapping(mesh, dims, (lo, hi), 0, (0, shape[d]), {}, found)
        if not found:
            return []
        per_dim.append(found)
    return [{k: v for part in combo for k, v in part.items()} for combo in product(*per_dim)]


def _overlapping(
    mesh: tuple[int, ...],
    dims: list[int],
    box: tuple[int, int],
    i: int,
    span: tuple[int, int],
    coords: dict[int, int],
    found: list[dict[int, int]],
) -> None:
    """Add to ``found`` the coordinates along mesh dims ``dims[i:]`` (each splitting what the one
    before left, torch's nesting) of the non-empty chunks of ``span`` that meet ``box``."""
    if i == len(dims):
        found.append(dict(coords))
        return
    n = mesh[dims[i]]
    start, size = span[0], span[1] - span[0]
    step = -(-size // n)
    if step == 0:
        return
    for c in range(max(0, (box[0] - start) // step), min(n - 1, (box[1] - 1 - start) // step) + 1):
        a, b = _split(size, n, c)
        if a < b and start + a < box[1] and box[0] < start + b:
            coords[dims[i]] = c
            _overlapping(mesh, dims, box, i + 1, (start + a, start + b), coords, found)
            del coords[dims[i]]


# --------------------------------------------------------------------------- build (save)


def build_index(leaf: str, holders: list[tuple[str, IndexPart]]) -> bytes:
    """The index of ``leaf`` from every holding rank's ``(layout tag, part)``, in rank order (the
    same input on every rank gives the same bytes). A parameter the parts do not describe alike
    (another description on another rank, a rank of its mesh without it, plain on one rank and
    sharded on another) is listed as ``chunks`` of every tag that holds part of it.

    Equal pieces of the parts (its descriptions, its whole FQNs, its chunked FQNs) should be one
    object (what the save's exchange gives): each distinct piece is walked once, so the work is
    the distinct pieces' size plus the ranks, not the tensors times the ranks."""
    tags = sorted({tag for tag, _part in holders}, key=_tag_order)
    tag_index = {tag: i for i, tag in enumerate(tags)}
    rank_tag: dict[int, int] = {}
    for tag in tags:
        for rank in _tag_ranks(tag):
            rank_tag[rank] = tag_index[tag]
    pieces: dict[tuple[int, int], tuple[Any, set[int]]] = {}  # (kind, id) -> (piece, tags holding it)
    spec_piece_of: dict[int, int] = {}  # tag -> id of its descriptions piece
    for tag, part in holders:
        t = tag_index[tag]
        for kind, piece in enumerate(part):
            pieces.setdefault((kind, id(piece)), (piece, set()))[1].add(t)
        spec_piece_of[t] = id(part[0])
    spec_ids: dict[Spec, int] = {}  # each description once (it holds the mesh's ranks: hashed once)
    spec_fqns: dict[int, set[str]] = {}
    listed: dict[tuple[int, int], set[str]] = {}  # (descriptions piece, spec id) -> its FQNs
    kinds: dict[str, set[Any]] = {}  # fqn -> its spec ids, "whole", "chunks"
    found_in: dict[str, set[tuple[int, int]]] = {}  # fqn -> the pieces listing it
    for (kind, pid), (piece, _tags) in pieces.items():
        if kind == 0:
            for spec, fqns in piece:
                sid = spec_ids.setdefault(spec, len(spec_ids))
                spec_fqns.setdefault(sid, set()).update(fqns)
                listed.setdefault((pid, sid), set()).update(fqns)
                for fqn in fqns:
                    kinds.setdefault(fqn, set()).add(sid)
                    found_in.setdefault(fqn, set()).add((kind, pid))
        else:
            for fqn in piece:
                kinds.setdefault(fqn, set()).add("whole" if kind == 1 else "chunks")
                found_in.setdefault(fqn, set()).add((kind, pid))
    # a spec is trusted for an FQN only if every rank of its mesh listed the FQN under it
    specs = list(spec_ids)
    good_spec: dict[int, set[str]] = {}
    for sid, fqns in spec_fqns.items():
        ok = set(fqns)
        for pid in {spec_piece_of.get(rank_tag.get(rank, -1)) for rank in specs[sid][2]}:
            ok &= listed.get((pid, sid), set()) if pid is not None else set()
        good_spec[sid] = ok
    holding: dict[frozenset[tuple[int, int]], tuple[int, ...]] = {}  # pieces -> the tags holding any

    def tags_of(fqn: str) -> tuple[int, ...]:
        key = frozenset(found_in[fqn])
        if key not in holding:
            holding[key] = tuple(sorted({t for piece in key for t in pieces[piece][1]}))
        return holding[key]

    described: dict[Spec, list[str]] = {}
    whole_of: dict[tuple[int, ...], list[str]] = {}
    chunks_of: dict[tuple[int, ...], list[str]] = {}
    for fqn in sorted(kinds):
        kind = kinds[fqn]
        only = next(iter(kind)) if len(kind) == 1 else None
        if type(only) is int and fqn in good_spec[only]:
            described.setdefault(specs[only], []).append(fqn)
        elif only == "whole":
            whole_of.setdefault(tags_of(fqn), []).append(fqn)
        else:
            chunks_of.setdefault(tags_of(fqn), []).append(fqn)
    meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for spec in sorted(described, key=repr):
        shape, mesh_shape, mesh_ranks, placements = spec
        mi = meshes.setdefault((mesh_shape, mesh_ranks), len(meshes))
        groups.append(({"shape": shape, "mesh": mi, "placements": placements}, described[spec]))
    groups += [({"whole": t}, f) for t, f in sorted(whole_of.items())]
    groups += [({"chunks": t}, f) for t, f in sorted(chunks_of.items())]
    header = {HEADER: INDEX_VERSION, "tags": tuple(tags), "meshes": tuple(meshes)}
    return encode_table(leaf, [(header, []), *groups])


def _tag_order(tag: str) -> tuple[int, str]:
    return min(_tag_ranks(tag)), tag


def _tag_ranks(tag: str) -> list[int]:
    parsed = parse_rank_tag(tag)
    if parsed is None:  # pragma: no cover - layout tags are rank tags
        raise CheckpointFormatError(f"layout tag {tag!r} is not a rank tag")
    return [r for first, last, step in parsed[1] for r in range(first, last + 1, step)]


# --------------------------------------------------------------------------- decode and select (load)


@dataclass
class LayoutIndex:
    """A decoded layout index: ``tags`` (layout rank tags), each FQN's description."""

    leaf: str
    key: str
    tags: tuple[str, ...]
    rank_tag: dict[int, int]
    """Saved global rank -> index of the tag holding its layout."""
    of: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """FQN -> ``("spec", Spec)``, ``("whole", tag indices)`` or ``("chunks", tag indices)``."""

    def tags_for(
        self, needs: Iterable[tuple[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]
    ) -> set[str]:
        """The layout tags to read for ``needs``: ``(FQN, (global shape, offsets, sizes))`` of the
        chunks this rank needs. Each needed FQN the index lists gets the tables whose chunks
        overlap its chunk (one per distinct saved chunk, a tag already chosen preferred), at least
        one (so its state keys, dtype and shape are read even for an empty chunk)."""
        pieces: list[tuple[int, ...]] = []  # each: alternatives, any one of which suffices
        cache: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}
        for fqn, chunk in needs:
            desc = self.of.get(fqn)
            if desc is None:
                continue
            kind, value = desc
            if kind == "whole":
                pieces.append(value)
            elif kind == "chunks":
                pieces.extend((t,) for t in value)
            else:  # FQNs of one description share its tuple: keyed by identity, not by its ranks
                key = (id(value), chunk)
                if key not in cache:
                    cache[key] = self._spec_pieces(value, chunk)
                pieces.extend(cache[key])
        chosen: set[int] = set()
        for alternatives in sorted(set(pieces), key=len):
            if not chosen.intersection(alternatives):
                chosen.add(min(alternatives))
        return {self.tags[t] for t in chosen}

    def _spec_pieces(
        self, spec: Spec, chunk: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        shape, mesh, ranks, _placements = spec
        target_shape, offsets, sizes = chunk
        coords = shard_ranges(spec, offsets, sizes) if target_shape == shape else []
        if not coords:
            coords = [{}]  # nothing overlaps (an empty chunk, another shape): any one table listing it
        strides = [math.prod(mesh[m + 1 :]) for m in range(len(mesh))]
        out = []
        for fixed in coords:
            free = [m for m in range(len(mesh)) if m not in fixed]
            alternatives = set()
            for combo in islice(product(*(range(mesh[m]) for m in free)), MAX_REPLICAS):
                flat = sum(fixed[m] * strides[m] for m in fixed) + sum(c * strides[m] for m, c in zip(free, combo))
                alternatives.add(self.rank_tag[ranks[flat]])
            out.append(tuple(sorted(alternatives)))
        return out


def check_index(index: LayoutIndex, tables: dict[str, list[tuple[str, str, Any, Any, Any]]]) -> None:
    """The index agrees with the leaf's layout tables (``tables``: rank tag -> its decoded entries
    ``(fqn, key, shape, offsets, sizes)``): every table is one of its tags, and every chunk is where
    the index says (a description's chunk for the tag's first rank, whole, or in a tag it lists);
    else a :class:`CheckpointFormatError` naming leaf, FQN, key and the index (what ``verify``
    checks of a checkpoint; a load checks only what it reads)."""
    where = {tag: i for i, tag in enumerate(index.tags)}
    coords: dict[Spec, dict[int, tuple[int, ...]]] = {}
    chunks: dict[tuple[Spec, int], Any] = {}
    for tag, entries in tables.items():
        ti = where.get(tag)
        if ti is None:
            raise CheckpointFormatError(
                f"leaf {index.leaf!r}: layout index {index.key!r} does not list layout tag {tag!r} (a damaged or "
                "edited checkpoint)"
            )
        rank = min(_tag_ranks(tag))
        for fqn, key, shape, offsets, sizes in entries:
            desc = index.of.get(fqn)
            ok = False
            if desc is not None and desc[0] == "spec":
                spec = desc[1]
                if spec not in coords:
                    coords[spec] = {r: _unravel(i, spec[1]) for i, r in enumerate(spec[2])}
                coord = coords[spec].get(rank)
                if coord is not None and (spec, rank) not in chunks:
                    chunks[(spec, rank)] = chunk_at(spec, coord)
                ok = spec[0] == shape and coord is not None and same_chunk(chunks[(spec, rank)], (offsets, sizes))
            elif desc is not None:
                ok = ti in desc[1] and (desc[0] == "chunks" or (offsets == (0,) * len(shape) and sizes == shape))
            if not ok:
                raise CheckpointFormatError(
                    f"leaf {index.leaf!r}: state {key!r} of {fqn!r} in layout tag {tag!r} is not where the layout "
                    f"index {index.key!r} says (a damaged or edited checkpoint)"
                )


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat //= d
    return tuple(reversed(out))


def same_chunk(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """The same chunk: equal sizes, and equal offsets unless it is empty (where torch places an
    empty shard does not matter: it holds nothing)."""
    return a[1] == b[1] and (0 in a[1] or a[0] == b[0])


_Bad = Callable[[str], CheckpointFormatError]
"""`decode_index`'s refusal: ``bad(what)`` is the error naming leaf, index key and ``what``."""
_Mesh = tuple[tuple[int, ...], tuple[int, ...]]


def decode_index(leaf: str, key: str, data: bytes) -> LayoutIndex:
    """Index item ``key``'s (unsealed) bytes, decoded and checked: a :class:`CheckpointFormatError`
    naming leaf and key for any defect (the table codec's own checks, then the index's: version,
    rank tags of one world, meshes of distinct saved ranks each holding a layout, descriptions in
    range, an FQN listed once)."""

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"leaf {leaf!r}: layout index {key!r}: {what} (a damaged or edited checkpoint)")

    settings, _blobs, groups = decode_table(leaf, data)
    header = _index_header(settings, groups, bad)
    tags = header["tags"]
    runs = _index_runs(tags, bad)
    checked_meshes = _index_meshes(header["meshes"], bad)
    rank_tag = _tags_of({r for _shape, ranks in checked_meshes for r in ranks}, runs)
    missing = [r for _shape, ranks in checked_meshes for r in ranks if r not in rank_tag]
    if missing:
        raise bad(f"mesh rank {missing[0]} holds none of the index's layout tags")
    out = LayoutIndex(leaf, key, tags, rank_tag)
    for idx, fqns in groups[1:]:
        value = _index_description(idx, settings[idx], len(tags), checked_meshes, bad)
        for fqn in fqns:
            if fqn in out.of:
                raise bad(f"parameter {fqn!r} is listed twice")
            out.of[fqn] = value
    return out


def _index_header(settings: Any, groups: Any, bad: _Bad) -> dict[str, Any]:
    """The index's header (the first group's settings, listing no FQN): its version this library's,
    its keys the version, ``tags`` (checked here: a non-empty tuple of str) and ``meshes``."""
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
    return header


def _index_runs(tags: tuple[str, ...], bad: _Bad) -> list[list[tuple[int, int, int]]]:
    """Each tag's rank runs; every tag a rank tag of one world."""
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
    return runs


def _index_meshes(meshes: Any, bad: _Bad) -> list[_Mesh]:
    """The header's meshes, each ``(shape, ranks)`` of a shape within ``MAX_NDIM`` listing each of its
    ranks once."""
    if type(meshes) is not tuple:
        raise bad("meshes are not a tuple")
    checked_meshes: list[_Mesh] = []
    for mesh in meshes:
        if type(mesh) is not tuple or len(mesh) != 2 or not all(_ints(x) for x in mesh):
            raise bad("a mesh is not (shape, ranks)")
        shape, ranks = mesh
        if not shape or len(shape) > MAX_NDIM or any(d < 1 for d in shape) or math.prod(shape) != len(ranks):
            raise bad(f"mesh of shape {shape} lists {len(ranks)} ranks")
        if len(set(ranks)) != len(ranks):
            raise bad(f"mesh {shape} lists a rank twice")
        checked_meshes.append((shape, ranks))
    return checked_meshes


def _index_description(idx: int, desc: Any, n_tags: int, meshes: list[_Mesh], bad: _Bad) -> tuple[str, Any]:
    """Description ``idx`` (settings ``desc``) checked against the index's ``n_tags`` tags and
    ``meshes``: ``("spec", (shape, mesh shape, mesh ranks, placements))`` or ``("whole"|"chunks",
    tag indices)``."""
    if set(desc) == {"shape", "mesh", "placements"}:
        shape, mi, placements = desc["shape"], desc["mesh"], desc["placements"]
        if not _ints(shape) or len(shape) > MAX_NDIM or any(d < 0 for d in shape):
            raise bad(f"description {idx}: shape {shape!r}")
        if type(mi) is not int or not 0 <= mi < len(meshes):
            raise bad(f"description {idx}: mesh {mi!r} out of range")
        mesh_shape, mesh_ranks = meshes[mi]
        if (
            not _ints(placements)
            or len(placements) != len(mesh_shape)
            or any(not REPLICATE <= p < len(shape) for p in placements)
        ):
            raise bad(
                f"description {idx}: placements {placements!r} for a {len(shape)}-d tensor on a "
                f"{len(mesh_shape)}-d mesh"
            )
        return ("spec", (shape, mesh_shape, mesh_ranks, placements))
    if len(desc) == 1 and next(iter(desc)) in ("whole", "chunks"):
        kind = next(iter(desc))
        ts = desc[kind]
        if not _ints(ts) or not ts or any(not 0 <= t < n_tags for t in ts):
            raise bad(f"description {idx}: {kind} tags {ts!r}")
        return (kind, tuple(ts))
    raise bad(f"description {idx} has keys {sorted(desc)}")


def _tags_of(ranks: set[int], runs: list[list[tuple[int, int, int]]]) -> dict[int, int]:
    """``rank -> index of the first tag listing it`` for ``ranks`` (work bounded by the ranks asked
    for, not by a tag's claimed world: a hostile ``w{huge}r0-{huge}`` costs nothing)."""
    out: dict[int, int] = {}
    for ti, tag_runs in enumerate(runs):
        for first, last, step in tag_runs:
            count = (last - first) // step + 1
            if count <= len(ranks):
                hits: Iterable[int] = (r for r in range(first, last + 1, step) if r in ranks)
            else:
                hits = (r for r in ranks if first <= r <= last and (r - first) % step == 0)
            for r in hits:
                out.setdefault(r, ti)
    return out


def _ints(value: object) -> bool:
    return type(value) is tuple and all(type(v) is int for v in value)
