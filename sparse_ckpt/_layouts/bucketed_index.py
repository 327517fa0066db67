"""``state_layout="buffers"``: this rank's contribution to each leaf's *layout index*
(:mod:`sparse_ckpt._format.layout_index`; docs/formats.md, *Layout index*).

:func:`with_index_parts` gives each layout slot of a coordinated save the rank's
:data:`~sparse_ckpt._format.layout_index.IndexPart`: the FQNs its layout table lists, by how they
are held -- a DTensor chunk that its sharding description gives this rank's mesh coordinate
(checked against the chunk in the layout, so the index never describes a chunking torch did not
do), a whole plain tensor, or any other chunk. `sparse_ckpt._format.tags.Keying` merges the
ranks' parts into the index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _backend
from .._format.bucket_checksums import split_checksums
from .._format.keys import BUFFERS_PREFIX, index_tag
from .._format.layout_index import REPLICATE, IndexPart, Spec, chunk_at, same_chunk
from .._format.tags import LAYOUT_SLOT, Slot


def index_key(leaf: str, ranks: str) -> str:
    """The key of a leaf's layout index held by ``ranks`` (docs/formats.md, *Layout index*)."""
    return f"{BUFFERS_PREFIX}{leaf}.{index_tag(ranks)}"


def with_index_parts(slots: list[Slot], param_of: Mapping[str, torch.Tensor]) -> list[Slot]:
    """``slots`` with each layout slot's index part set (its payload, the layout table, says which
    FQNs and chunks it holds; ``param_of`` how each parameter is sharded)."""
    meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]] = {}
    return [
        dataclasses.replace(s, index=_part(s, param_of, meshes)) if s.name.startswith(f"{LAYOUT_SLOT}:") else s
        for s in slots
    ]


def _part(slot: Slot, param_of: Mapping[str, torch.Tensor], meshes: dict[int, Any]) -> IndexPart:
    leaf = slot.name.partition(":")[2]
    # per (mesh, placements, shape): the description and the chunk it gives this rank, made once
    # (a description holds the mesh's ranks: it is never hashed per parameter)
    known: dict[tuple[Any, ...], tuple[Spec | None, Any]] = {}
    specs: dict[tuple[Any, ...], list[str]] = {}
    whole: list[str] = []
    chunked: list[str] = []
    done: set[str] = set()
    table, _crcs = split_checksums(leaf, slot.name, slot.payload)
    for _dtype, _numel, entries in _backend.core.decode_layout(leaf, table):
        for fqn, _key, shape, offsets, sizes in entries:
            if fqn in done:
                continue
            done.add(fqn)
            p = param_of.get(fqn)
            if not isinstance(p, DTensor):
                (whole if offsets == (0,) * len(shape) and sizes == shape else chunked).append(fqn)
                continue
            key = (id(p.device_mesh), p.placements, shape)
            if key not in known:
                spec, coord = _spec(p, shape, meshes)
                known[key] = (spec, chunk_at(spec, coord) if spec is not None and coord is not None else None)
            mine = known[key][1]
            if mine is not None and same_chunk(mine, (offsets, sizes)):
                specs.setdefault(key, []).append(fqn)
            else:
                chunked.append(fqn)
    described = tuple((known[key][0], tuple(sorted(f))) for key, f in specs.items())
    return described, tuple(sorted(whole)), tuple(sorted(chunked))  # type: ignore[return-value]


def _spec(p: DTensor, shape: tuple[int, ...], meshes: dict[int, Any]) -> tuple[Spec | None, tuple[int, ...] | None]:
    """``(sharding description, this rank's mesh coordinate)`` of DTensor ``p``; ``(None, None)``
    for placements other than ``Shard``/``Replicate``."""
    codes = []
    for pl in p.placements:
        if type(pl) is Replicate:
            codes.append(REPLICATE)
        elif type(pl) is Shard:
            codes.append(pl.dim % max(1, len(shape)))
        else:
            return None, None
    mesh = p.device_mesh
    known = meshes.get(id(mesh))
    if known is None:
        coord = mesh.get_coordinate()
        known = meshes[id(mesh)] = (
            tuple(mesh.shape),
            tuple(int(r) for r in mesh.mesh.flatten().tolist()),
            None if coord is None else tuple(int(c) for c in coord),
        )
    mesh_shape, ranks, coord = known
    return (tuple(shape), mesh_shape, ranks, tuple(codes)), coord
