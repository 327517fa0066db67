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

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._dist import world_and_rank
from .item_record import items_record, with_items_record
from .keys import (
    BUFFERS_PREFIX,
    PACKED_PREFIX,
    SCALARS_PREFIX,
    buffer_tag,
    digest_tag,
    layout_tag,
    rank_tag,
    seal,
    table_digest,
    table_item_key,
)

GROUPS_SLOT = "groups"
SCALARS_SLOT = "scalars"
LAYOUT_SLOT = "layout"


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
        if self.world == 1:
            tag = rank_tag(1, [0])
            return _sealed(slots, [tag] * len(slots), [(s.name, tag, s.buckets) for s in slots])
        if not self.coordinated:  # no record: this rank cannot know the others' items
            own = rank_tag(self.world, [self.rank])
            return [(digest_tag(s.payload), s.payload) if s.by_digest else (own, seal(s.payload)) for s in slots]
        digests = [table_digest(s.payload) for s in slots]
        mine = [(s.name, d, s.buckets) for s, d in zip(slots, digests)]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        held = [{name: (d, buckets) for name, d, buckets in entries} for entries in everyone]

        def tag_of(name: str, digest: str) -> str:
            return rank_tag(self.world, [r for r, h in enumerate(held) if h.get(name, ("",))[0] == digest])

        written = [(name, tag_of(name, d), buckets) for h in held for name, (d, buckets) in h.items()]
        return _sealed(slots, [tag_of(s.name, d) for s, d in zip(slots, digests)], written)


def _sealed(slots: list[Slot], tags: list[str], written: list[tuple[str, str, tuple[str, ...]]]) -> list[tuple[str, bytes]]:
    """``(tag, sealed value)`` per slot; the tables carry the keys of every item in ``written``
    (``(slot name, tag, buckets)`` of every rank's slots), sorted, without repeats."""
    record = None
    if any(s.tail is not None for s in slots):
        record = items_record(sorted({key for name, tag, buckets in written for key in slot_keys(name, tag, buckets)}))
    return [
        (tag, seal(s.payload if s.tail is None or record is None else with_items_record(s.payload, s.tail, record)))
        for s, tag in zip(slots, tags)
    ]
