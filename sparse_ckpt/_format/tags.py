"""How one save names its table items: stable keys, values move (docs/formats.md,
*Table keys*).

A save collects its tables as *slots* (one per table: which table of which leaf, and its content
digest) and asks a :class:`Keying` for their tags. In one process every tag is ``w1r0``. Ranks
that save together through ``dcp.save`` exchange their slots' digests in one collective and tag
each table with the set of ranks holding exactly it, so equal tables share one key (written
once), different ones never do, and keys stay put while values move alike on every rank. Ranks
that cannot coordinate key tables by content digest and layouts by their own rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._dist import world_and_rank
from .item_record import items_record, items_record_parts
from .keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    buffer_tag,
    digest_tag,
    index_tag,
    layout_tag,
    rank_tag,
    seal,
    seal_parts,
    table_digest,
    table_item_key,
)
from .layout_index import IndexPart, build_index

GROUPS_SLOT = "groups"
SCALARS_SLOT = "scalars"
LAYOUT_SLOT = "layout"
INDEX_SLOT = "index"
"""Not a slot of its own: the name under which a leaf's layout index is in the save's item record."""


@dataclass(frozen=True)
class Slot:
    """One item of a save that needs a tag."""

    name: str
    """Unique within the rank's save, equal on ranks for the same table (e.g. ``"groups:{leaf}"``)."""
    payload: bytes
    """The table's bytes (what the digest is of)."""
    by_digest: bool = True
    """Without coordination: keyed by content digest (``True``: tables) or by the rank itself
    (``False``: layout tables and buffers, which a loading rank must find by its rank)."""
    buckets: tuple[str, ...] = ()
    """A layout slot's buckets: each one's dtype (their keys are part of the save's item record)."""
    tail: int | None = None
    """Group tables: the byte length of the table's groups part (`sparse_ckpt._format.item_record.groups_tail`);
    their sealed values carry the save's item record (`sparse_ckpt._format.item_record.with_items_record`),
    so that a lost scalar table, layout or buffer -- or another leaf's group table -- is found missing."""
    index: IndexPart | None = None
    """A layout slot's part of its leaf's layout index (`sparse_ckpt._layouts.bucketed_index`): a
    coordinated save of several ranks writes the index when every layout slot of the leaf has one."""

    @staticmethod
    def of(kind: str, leaf: str, payload: bytes, *, buckets: tuple[str, ...] = (), tail: int | None = None) -> Slot:
        """The slot of a leaf's group table, scalar table or layout (``kind``: ``*_SLOT``)."""
        return Slot(f"{kind}:{leaf}", payload, by_digest=kind != LAYOUT_SLOT, buckets=buckets, tail=tail)


def slot_keys(name: str, tag: str, buckets: tuple[str, ...]) -> list[str]:
    """The item keys (in the optimizer dict) that a slot named by :meth:`Slot.of` gets with ``tag``."""
    kind, _sep, leaf = name.partition(":")
    if kind == GROUPS_SLOT:
        return [table_item_key(PACKED_PREFIX, leaf, tag)]
    if kind == SCALARS_SLOT:
        return [table_item_key(SCALARS_PREFIX, leaf, tag)]
    if kind == LAYOUT_SLOT:
        head = f"{BUFFERS_PREFIX}{leaf}."
        return [head + layout_tag(tag), *(head + buffer_tag(i, tag, dtype) for i, dtype in enumerate(buckets))]
    if kind == INDEX_SLOT:
        return [f"{BUFFERS_PREFIX}{leaf}.{index_tag(tag)}"]
    return []


@dataclass(frozen=True)
class Keying:
    """The tagging rule of one save (see the module docstring)."""

    world: int = 1
    rank: int = 0
    coordinated: bool = False
    """Exchange digests with every rank of the default process group (one ``all_gather_object``)."""

    @staticmethod
    def here() -> Keying:
        """What a save that cannot coordinate uses: one process, or this rank of its process group."""
        world, rank = world_and_rank()
        return Keying(world, rank, False) if world > 1 else Keying()

    @staticmethod
    def with_ranks() -> Keying:
        """What a save by all ranks of the default process group together (``dcp.save``) uses."""
        here = Keying.here()
        return Keying(here.world, here.rank, here.world > 1)

    def assign(self, slots: list[Slot]) -> list[tuple[str, bytes]]:
        """``(tag, value)`` of every slot, in order: rank-tagged values are sealed
        (:func:`~sparse_ckpt._format.keys.seal`), digest-tagged ones are the table itself."""
        return self.assign_with_indexes(slots)[0]

    def assign_with_indexes(self, slots: list[Slot]) -> tuple[list[tuple[str, bytes]], dict[str, tuple[str, bytes]]]:
        """:meth:`assign`, and the layout indexes of the save: ``leaf -> (tag, sealed index)`` for
        each leaf whose layout slots carry index parts, in a coordinated save of several ranks
        (docs/formats.md, *Layout index*; their keys are in the item record)."""
        if self.world == 1:
            tag = rank_tag(1, [0])
            return _sealed(slots, [tag] * len(slots), [(s.name, tag, s.buckets) for s in slots]), {}
        if not self.coordinated:  # no record: this rank cannot know the others' items
            own = rank_tag(self.world, [self.rank])
            return [(digest_tag(s.payload), s.payload) if s.by_digest else (own, seal(s.payload)) for s in slots], {}
        digests = [table_digest(s.payload) for s in slots]
        mine = [(s.name, d, s.buckets, _part_digest(s.index)) for s, d in zip(slots, digests)]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        held = [{name: (d, buckets, part) for name, d, buckets, part in entries} for entries in everyone]

        tags: dict[tuple[str, str], str] = {}

        def tag_of(name: str, digest: str) -> str:
            tag = tags.get((name, digest))
            if tag is None:
                ranks = [r for r, h in enumerate(held) if h.get(name, ("",))[0] == digest]
                tag = tags[(name, digest)] = rank_tag(self.world, ranks)
            return tag

        written = [(name, tag_of(name, d), buckets) for h in held for name, (d, buckets, _p) in h.items()]
        holders = _index_holders(held)
        written += [(f"{INDEX_SLOT}:{leaf}", rank_tag(self.world, ranks), ()) for leaf, ranks in holders.items()]
        indexes = self._indexes(slots, held, holders, tag_of)
        return _sealed(slots, [tag_of(s.name, d) for s, d in zip(slots, digests)], written), indexes

    def _indexes(
        self, slots: list[Slot], held: list[dict[str, Any]], holders: dict[str, list[int]], tag_of: Any
    ) -> dict[str, tuple[str, bytes]]:
        """The layout index of each leaf this rank holds a layout of (``holders``: leaf -> ranks
        with a layout of it), from those ranks' index parts. A part's pieces (descriptions, whole
        FQNs, chunked FQNs) are exchanged by digest: a piece a rank needs and does not hold itself
        travels in one more ``all_gather_object``, sent by its first holder (each distinct piece
        once; with FSDP alone every rank's pieces are the same and nothing travels)."""
        own = {d: piece for s in slots if s.index is not None for d, piece in zip(_part_digest(s.index), s.index)}
        first: dict[str, int] = {}
        lacking = False
        for leaf, ranks in holders.items():
            name = f"{LAYOUT_SLOT}:{leaf}"
            needed = {d for r in ranks for d in held[r][name][2]}
            for r in ranks:
                for d in held[r][name][2]:
                    first.setdefault(d, r)
                mine = {d for n, entry in held[r].items() if n.startswith(f"{LAYOUT_SLOT}:") for d in entry[2]}
                lacking = lacking or not needed <= mine
        pieces = own
        if lacking:  # the same decision on every rank: it rests on the gathered digests alone
            sent: list[Any] = [None] * self.world
            dist.all_gather_object(sent, {d: own[d] for d, r in first.items() if r == self.rank})
            pieces = {d: piece for gathered in sent for d, piece in gathered.items()}
        out: dict[str, tuple[str, bytes]] = {}
        for leaf, ranks in holders.items():
            if self.rank not in ranks:
                continue
            name = f"{LAYOUT_SLOT}:{leaf}"
            found = [(tag_of(name, held[r][name][0]), tuple(pieces[d] for d in held[r][name][2])) for r in ranks]
            out[leaf] = (rank_tag(self.world, ranks), seal(build_index(leaf, found)))  # type: ignore[arg-type]
        return out


def _index_holders(held: list[dict[str, Any]]) -> dict[str, list[int]]:
    """``leaf -> ranks holding a layout of it`` for every leaf whose layouts all carry an index part
    and are not all one table (replicas: a load reads that one table, there is nothing to choose)."""
    leaves: dict[str, list[int]] = {}
    for r, h in enumerate(held):
        for name in h:
            kind, _sep, leaf = name.partition(":")
            if kind == LAYOUT_SLOT:
                leaves.setdefault(leaf, []).append(r)
    return {
        leaf: ranks
        for leaf, ranks in leaves.items()
        if all(held[r][f"{LAYOUT_SLOT}:{leaf}"][2] for r in ranks)
        and len({held[r][f"{LAYOUT_SLOT}:{leaf}"][0] for r in ranks}) > 1
    }


def _part_digest(part: IndexPart | None) -> tuple[str, ...]:
    """A digest of each piece of an index part (``()`` for none): equal pieces travel once."""
    if part is None:
        return ()
    return tuple(
        f"{i}:{hashlib.blake2b(repr(piece).encode('utf-8'), digest_size=16).hexdigest()}"
        for i, piece in enumerate(part)
    )


def _sealed(
    slots: list[Slot], tags: list[str], written: list[tuple[str, str, tuple[str, ...]]]
) -> list[tuple[str, bytes]]:
    """``(tag, sealed value)`` per slot; the tables carry the keys of every item in ``written``
    (``(slot name, tag, buckets)`` of every rank's slots), sorted, without repeats."""
    record = None
    if any(s.tail is not None for s in slots):
        record = items_record(sorted({key for name, tag, buckets in written for key in slot_keys(name, tag, buckets)}))
    return [
        (
            tag,
            seal(s.payload)
            if s.tail is None or record is None
            else seal_parts(items_record_parts(s.payload, s.tail, record)),
        )
        for s, tag in zip(slots, tags)
    ]
