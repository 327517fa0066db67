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
from .keys import digest_tag, rank_tag, seal, table_digest


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
            return [(tag, seal(s.payload)) for s in slots]
        if not self.coordinated:
            own = rank_tag(self.world, [self.rank])
            return [(digest_tag(s.payload), s.payload) if s.by_digest else (own, seal(s.payload)) for s in slots]
        digests = [table_digest(s.payload) for s in slots]
        mine = [(s.name, d) for s, d in zip(slots, digests)]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        held = [dict(entries) for entries in everyone]
        out = []
        for s, d in zip(slots, digests):
            ranks = [r for r, h in enumerate(held) if h.get(s.name) == d]
            out.append((rank_tag(self.world, ranks), seal(s.payload)))
        return out
