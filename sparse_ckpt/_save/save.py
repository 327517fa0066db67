"""``sparse_state_dict``: the exact, sparse optimizer state dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any, Literal

import torch

from .. import _backend
from .._dcp.origin import with_origin
from .._format.bucket_checksums import with_checksums
from .._format.codec import encode_settings, encode_table
from .._format.item_record import groups_tail
from .._format.keys import (
    PACKED_PREFIX,
    RESERVED_FQN_PREFIXES,
    SCALARS_PREFIX,
    foreign_guard_keys,
    foreign_guard_value,
    is_reserved_fqn,
    packed_table_key,
    table_digest,
    table_item_key,
)
from .._format.keys_record import build_key_record
from .._format.list_record import record_lists
from .._format.tags import GROUPS_SLOT, LAYOUT_SLOT, SCALARS_SLOT, Keying, Slot
from .._format.tensor_parts import CODEC_DTYPES, tensor_to_parts
from .._fqn import Model, build_fqn_map
from .._gc import gc_paused
from .._host_memory import HostPool
from .._layouts import StateLayout, bucketed, check_state_layout, own_item_bytes
from .._layouts.bucketed_index import index_key, with_index_parts
from .._leaves import named_leaves
from ..errors import CheckpointFormatError, CheckpointMismatchError
from .capture import capture_by_fqn
from .fill_plan import FillPlans
from .state_values import check_state_values
from .worker import CaptureWorker

Format = Literal["packed", "flat"]
FORMATS = ("packed", "flat")

_SCALAR_DTYPES: dict[torch.dtype, tuple[str, torch.dtype | None]] = {
    dt: (name, torch.int16 if dt == torch.bfloat16 else None) for name, dt in CODEC_DTYPES.items()
}
"""The dtypes the table codec holds (``_tensor_parts``), each with the dtype a CPU tensor is
viewed as for ``numpy()`` (bfloat16 has no numpy dtype)."""

_CPU_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    dt: (spec[0], dt.itemsize) for dt, spec in _SCALAR_DTYPES.items() if not dt.is_complex
}
"""``cpu_dtypes`` of ``core.flatten_packed_state``: the core reads a plain CPU 0-d tensor of these
dtypes itself (its element's bytes), exactly the parts `_scalar_parts` gives for it.
Complex dtypes (the only ones with a conj bit, which the core does not read) go through
`_scalar_parts`."""


__all__ = ["FORMATS", "Format", "packed_table_key", "sparse_state_dict", "table_digest"]


def sparse_state_dict(
    model: Model, optimizer: Any, *, format: Format = "packed", state_layout: StateLayout = "per_tensor"
) -> dict[str, Any]:
    """Return the optimizer's exact state as a flat ``dict[str, value]`` that DCP can save.

    Only state that exists is emitted (``state.{fqn}.{key}``); every group's settings are kept,
    also for leaves that never stepped. ``format="packed"`` (default) stores each leaf's groups
    as one binary table ``param_groups.__packed__.{leaf}.{tag}``; ``format="flat"`` uses torch
    DSD's ``param_groups.{fqn}.{key}`` layout. Nothing is mutated and no step is run.

    Table keys (docs/formats.md, *Table keys*): ``w1r0`` in one process; in a
    process group of several ranks this function cannot coordinate with the others, so tables
    are keyed by their content digest (a `sparse_ckpt.SparseOptimizerState` saved by
    ``dcp.save`` gets stable, rank-set keys instead).

    ``state_layout="per_tensor"`` (the default here: the dict holds the live state tensors, no
    copy) gives one item per tensor; ``"buffers"`` (packed format only) puts each leaf's
    parameter-shaped state tensors into a few 1-D buffers (copies) with a layout table, ``"auto"``
    (what `sparse_ckpt.SparseOptimizerState` saves by default) only those below a size (see
    docs/dcp.md, *State layout*); with ``format="flat"``, ``"auto"`` is one item per tensor.

    In a process group of more than one rank the dict records its rank (docs/semantics.md): pickled
    (``torch.save``) or copied, it is refused by a load on another rank or world size.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    check_state_layout(state_layout, format)
    with gc_paused():
        return with_origin(build_state_dict(model, optimizer, format, Keying.here(), state_layout))


def build_state_dict(
    model: Model,
    optimizer: Any,
    format: Format,
    keying: Keying,
    state_layout: StateLayout = "per_tensor",
    *,
    guards: bool = False,
    staged: bool = False,
    snapshots: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    pool: HostPool | None = None,
    plans: FillPlans | None = None,
) -> dict[str, Any]:
    """`sparse_state_dict` with the table keys chosen by ``keying`` (called with gc paused);
    ``guards=True`` (what the DCP ``Stateful`` saves, packed format) adds the foreign-loader guards
    (`sparse_ckpt._format.keys.foreign_guard_keys`); ``staged``: for ``dcp.async_save``, which
    copies the dict before it returns (``state_layout="auto"`` then buffers fewer tensors,
    `sparse_ckpt._layouts.own_item_bytes`); ``snapshots``: ``(value, its copy)`` is appended to it for
    every value of the dict this call copied: each bucket filled with copies of the state (its own
    copy: no live tensor aliases it, `sparse_ckpt._layouts.bucketed.fill`) and, with ``staged`` and
    ``pool``, each large CPU state tensor copied into a buffer of ``pool``
    (`sparse_ckpt._save.worker.CaptureWorker.stage`); ``pool``: where CPU buckets and those copies
    are allocated (reused from save to save). The bucket CRCs and the large copies run on a second
    thread while the capture goes on (`sparse_ckpt._save.worker`); it is done when this returns.
    ``plans`` (with ``pool``): the previous capture's fills, copied again on that thread from the start
    and used where the layout is the same (`sparse_ckpt._save.fill_plan`; one capture at a time: a
    capture while another thread's holds them goes without)."""
    copied: list[torch.Tensor] | None = [] if snapshots is not None else None
    worker = CaptureWorker()
    try:
        if plans is not None and (pool is None or not plans.claim()):
            plans = None  # (claimed by a capture in another thread: this one goes without)
        leaves = named_leaves(optimizer)
        if plans is not None:
            plans.start(pool, worker, dict(leaves))  # type: ignore[arg-type]
        out = _build(model, leaves, format, keying, state_layout, guards, staged, copied, pool, worker, plans)
        if snapshots is not None:
            snapshots.extend((b, b) for b in copied or ())
            if plans is not None:
                plans.help()  # (the copies of staged tensors only, which no layout waited for)
            snapshots.extend(worker.copies())
    finally:
        if plans is not None:
            plans.release()
        worker.close()
    return out


def _build(
    model: Model,
    leaves: list[tuple[str, Any]],
    format: Format,
    keying: Keying,
    state_layout: StateLayout,
    guards: bool,
    staged: bool,
    copied: list[torch.Tensor] | None,
    pool: HostPool | None,
    worker: CaptureWorker,
    plans: FillPlans | None,
) -> dict[str, Any]:
    """`build_state_dict`'s body, with its worker thread."""
    core = _backend.core
    fmap = build_fqn_map(model)
    parts: list[_Part] = []  # the dict's items in order; tables and layouts wait for their tags
    slots: list[Slot] = []
    owner: dict[str, str] = {}
    first_fqns: list[str] = []
    recorded: list[tuple[list[tuple[dict, list[str]]], dict[str, Any]]] = []  # flat: each leaf's groups and state
    for leaf, opt in leaves:
        groups_fqn, state_fqn = capture_by_fqn(leaf, opt, fmap.fqn_of)
        first = next((fqns[0] for _settings, fqns in groups_fqn if fqns), None)
        if first is not None:
            first_fqns.append(first)
        repeats = core.claim_owners(leaf, groups_fqn, owner)
        if repeats:  # a parameter in two groups of this leaf (torch allows it)
            _check_repeats(leaf, groups_fqn, repeats)
        _refuse_reserved(leaf, state_fqn)
        if format == "packed":  # version 2: leading scalars in a scalar table
            items, scalar_groups = core.flatten_packed_state(
                leaf, state_fqn, fmap.param_of, torch.Tensor, _CPU_DTYPES, torch.strided, _scalar_parts
            )
            check_state_values(leaf, state_fqn, items.values())
            if scalar_groups:
                scalar_groups = record_lists(items, scalar_groups)
                if state_layout != "per_tensor":  # no per-item keys to carry the state order
                    scalar_groups = _in_state_order(scalar_groups, state_fqn)
                scalars = encode_table(leaf, scalar_groups)
                parts.append(_Part("table", leaf, prefix=SCALARS_PREFIX))
                slots.append(Slot.of(SCALARS_SLOT, leaf, scalars))
            addresses: list[int | None] | None = None
            entries: list[tuple[Any, ...]] = []
            local: list[torch.Tensor] = []
            if state_layout != "per_tensor":
                addresses = [] if plans is not None else None
                limit = own_item_bytes(state_layout, staged)
                entries, local = bucketed.collect(leaf, state_fqn, items, fmap.param_of, limit, addresses)
            if staged and pool is not None:  # the large items: the worker copies them while the capture
                _stage(leaf, items, pool, worker, plans)  # goes on (what it has not begun when needed is done here)
            if entries:
                layout, buckets, filled = _fill_layout(leaf, entries, local, addresses, copied, pool, worker, plans)
                parts.append(_Part("layout", leaf, buckets=filled))
                slots.append(Slot.of(LAYOUT_SLOT, leaf, layout, buckets=tuple(dtype for dtype, _n, _m in buckets)))
            parts.append(_Part("items", leaf, items=items))
            parts.append(_Part("table", leaf, prefix=PACKED_PREFIX))
            table = encode_table(leaf, groups_fqn)
            slots.append(Slot.of(GROUPS_SLOT, leaf, table, tail=groups_tail(list(map(itemgetter(1), groups_fqn)))))
        else:
            items = core.flatten_state(leaf, state_fqn, fmap.param_of, False)
            check_state_values(leaf, state_fqn, items.values())
            if staged and pool is not None:
                _stage(leaf, items, pool, worker, plans)
            parts.append(_Part("items", leaf, items=items))
            _check_flat_settings(leaf, groups_fqn)
            parts.append(_Part("items", leaf, items=core.flatten_groups(leaf, groups_fqn)))
            recorded.append((groups_fqn, state_fqn))
    if keying.coordinated:  # each leaf's layout index: which ranks' layouts hold which chunks
        slots = with_index_parts(slots, fmap.param_of)
    assigned, indexes = keying.assign_with_indexes(slots)
    tagged = iter(assigned)
    out: dict[str, Any] = {}
    for part in parts:
        if part.kind == "items":
            out.update(part.items)
            continue
        tag, value = next(tagged)
        if part.kind == "table":
            out[table_item_key(part.prefix, part.leaf, tag)] = value
        else:  # a layout table and its buckets
            out[bucketed.layout_key(part.leaf, tag)] = value
            for i, buf in enumerate(part.buckets):
                out[bucketed.buffer_key(part.leaf, tag, i, bucketed.dtype_name(buf.dtype))] = buf
            if part.leaf in indexes:
                out[index_key(part.leaf, indexes[part.leaf][0])] = indexes[part.leaf][1]
    if guards and format == "packed":
        out.update(dict.fromkeys(foreign_guard_keys(first_fqns), foreign_guard_value()))
    if format == "flat":  # the key record: complete or refused (docs/formats.md, *Key record*)
        key, value = build_key_record(chain.from_iterable(g for g, _s in recorded), [s for _g, s in recorded])
        out[key] = value
    return out


def _stage(leaf: str, items: dict[str, Any], pool: HostPool, worker: CaptureWorker, plans: FillPlans | None) -> None:
    """The staged copies of ``leaf``'s large items (`CaptureWorker.stage`): those the capture started from
    its plan where they hold (`sparse_ckpt._save.fill_plan.FillPlans.staged_copy`), the others on the
    worker; then planned for the next capture."""
    if plans is None:
        worker.stage(pool, items)
        return
    plans.record_staged(leaf, worker.stage(pool, items, lambda t: plans.staged_copy(leaf, t)))


def _fill_layout(
    leaf: str,
    entries: list[tuple[Any, ...]],
    local: list[torch.Tensor],
    addresses: list[int | None] | None,
    copied: list[torch.Tensor] | None,
    pool: HostPool | None,
    worker: CaptureWorker,
    plans: FillPlans | None,
) -> tuple[bytes, list[tuple[str, int, list[tuple[int, int]]]], list[torch.Tensor]]:
    """A leaf's layout table (with its buckets' CRC-32C, under its seal), the core's buckets and the
    filled buffers: the copy the capture started from the previous layout where it holds
    (`sparse_ckpt._save.fill_plan`; ``addresses``: the locals' plain addresses, with ``plans``), else
    `sparse_ckpt._layouts.bucketed.fill` (then planned for the next)."""
    if plans is not None and plans.busy(leaf):
        worker.help()  # (the large tensors' copies here, while the worker copies the buckets)
        plans.help(leaf)  # (then the pieces of the copy the worker has not begun)
    copy = plans.take(leaf, entries, local, addresses) if plans is not None else None
    if copy is not None:
        layout, buckets, filled, crcs = copy
        if copied is not None:
            copied.extend(filled)
    else:
        layout, buckets = _backend.core.encode_layout(leaf, entries, bucketed.BUCKET_BYTES)
        filled = bucketed.fill(buckets, local, copied, pool, list(map(itemgetter(6), entries)), worker)
        crcs = worker.crcs(len(filled))  # each bucket's (its halves', combined: bucketed.fill)
        if plans is not None:
            plans.record(leaf, entries, layout, buckets, local, addresses)
    return with_checksums(layout, crcs), buckets, filled


def _in_state_order(
    groups: list[tuple[dict[str, Any], list[str]]], state_fqn: Mapping[str, Any]
) -> list[tuple[dict[str, Any], list[str]]]:
    """A scalar table's groups as runs of parameters in state order, each run referring to its
    scalar dict (a dict shared by several runs is encoded once): the table then lists every
    parameter with state in the order the optimizer holds it, which a load restores when buffered
    state has no per-item key to say where it was (docs/formats.md, *Packed format*)."""
    if len(groups) < 2:
        return groups
    of = {fqn: settings for settings, fqns in groups for fqn in fqns}
    runs: list[tuple[dict[str, Any], list[str]]] = []
    for fqn in state_fqn:
        settings = of.get(fqn)
        if settings is None:
            continue
        if runs and runs[-1][0] is settings:
            runs[-1][1].append(fqn)
        else:
            runs.append((settings, [fqn]))
    return runs


@dataclass
class _Part:
    """One run of the dict being built, in order: ``items`` (ready), a ``table`` (its value and key
    wait for the tag of the next slot), or a ``layout`` table with its buckets (likewise)."""

    kind: Literal["items", "table", "layout"]
    leaf: str
    items: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""
    """A table's key prefix (group or scalar table)."""
    buckets: list[torch.Tensor] = field(default_factory=list)


def _scalar_parts(t: torch.Tensor) -> tuple[str, tuple[int, ...], str, bytes] | None:
    """The codec parts of a state tensor that goes into a scalar table, else ``None``.

    The core calls it for the 0-d state values of exact type ``torch.Tensor`` in a parameter's
    leading run that it does not encode itself (the plain CPU ones, see `_CPU_DTYPES`):
    other devices, autograd, conj/neg bits, other dtypes or layouts. It takes 0-d tensors of a
    dtype the codec holds, strided, without autograd, conj/neg bits or meta storage; the parts
    are exactly `tensor_to_parts`'s (CPU tensors read the element's bytes through numpy).
    """
    if t.ndim != 0 or t.requires_grad:
        return None
    spec = _SCALAR_DTYPES.get(t.dtype)
    if spec is None or t.layout is not torch.strided or t.is_conj() or t.is_neg():
        return None
    device = t.device.type
    if device != "cpu":
        return None if device == "meta" else tensor_to_parts(t)
    name, view = spec
    return name, (), "cpu", (t if view is None else t.view(view)).numpy().tobytes()


def _refuse_reserved(leaf: str, state_fqn: dict[str, Any]) -> None:
    """State of an FQN starting with ``__packed__.`` would read back as a table: refuse it."""
    # One substring search over the joined FQNs (C speed) rules out the usual case; a hit, or an
    # FQN that is no str, goes through the exact per-FQN check.
    try:
        joined = "\n" + "\n".join(state_fqn)
        if all(f"\n{prefix}" not in joined for prefix in RESERVED_FQN_PREFIXES):
            return
    except TypeError:
        pass
    for fqn in state_fqn:
        if is_reserved_fqn(fqn):
            raise CheckpointFormatError(
                f"leaf {leaf!r}: parameter {fqn!r} has state, and FQNs starting with {fqn.split('.')[0] + '.'!r} are "
                "reserved for the checkpoint's tables; rename the module"
            )


def _check_repeats(leaf: str, groups_fqn: list[tuple[dict, list[str]]], repeats: list[tuple[str, int]]) -> None:
    """Each repeated listing ``(fqn, group)`` must carry the settings of the FQN's first group."""
    first_group: dict[str, int] = {}
    for gi, (_settings, fqns) in enumerate(groups_fqn):
        for fqn in fqns:
            first_group.setdefault(fqn, gi)
    for fqn, gi in repeats:
        if first_group[fqn] != gi:
            _check_same_settings(leaf, fqn, groups_fqn, first_group[fqn], gi)


def _check_flat_settings(leaf: str, groups_fqn: list[tuple[dict, list[str]]]) -> None:
    """The flat format writes each setting as it is (DCP pickles what is not a tensor), but a load
    compares settings through the table codec: refuse at save, naming leaf, group and key, any
    value the codec does not hold (what the packed format refuses), so no flat checkpoint is
    written that cannot be loaded. The table itself is dropped: what building it costs beyond the
    settings is encoding the FQNs, which is the check of an FQN UTF-8 cannot encode (a module name
    with a lone surrogate), so a table-less check would only copy the codec's rules."""
    encode_table(leaf, groups_fqn)


def _check_same_settings(leaf: str, fqn: str, groups_fqn: list[tuple[dict, list[str]]], first: int, again: int) -> None:
    """A parameter listed in two groups of a leaf (torch allows it) is saved by FQN once: both
    groups must then hold the same settings, or a load could not tell which applies."""
    a = encode_settings(leaf, first, _bare(groups_fqn[first][0]))
    b = encode_settings(leaf, again, _bare(groups_fqn[again][0]))
    if a != b:
        raise CheckpointMismatchError(
            f"leaf {leaf!r}: parameter {fqn!r} is in group {first} and group {again} with different settings; "
            "a checkpoint keyed by FQN cannot say which applies"
        )


def _bare(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings without ``param_names`` (per-parameter metadata, not a setting)."""
    return {k: v for k, v in settings.items() if k != "param_names"} if "param_names" in settings else settings
