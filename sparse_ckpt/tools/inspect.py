"""``inspect``: describe every optimizer of a checkpoint (its report and the report's text form)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._dcp.metadata import find_optimizers, unrecognised_optimizer_items
from .._format.keys import PACKED_PREFIX, SCALARS_PREFIX
from .._text import first_n
from ._reader import (
    Group,
    dtype_name,
    item_bytes,
    loader_needed,
    named_groups,
    open_checkpoint,
    optimizer_format,
    optimizer_values,
    select_optimizers,
    split_optimizer,
)
from .verify import storage_problems

__all__ = ["expert_summary", "format_inspect", "id_ranges", "inspect_checkpoint", "inspect_details", "jsonable"]


def walk_state(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, leaf value)`` of one parameter's (nested) state."""
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        if isinstance(value, dict):
            out.extend(walk_state(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def jsonable(value: Any) -> Any:
    """A JSON-friendly rendering of a settings value (for reports, not for round trips)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {
            "tensor": dtype_name(value.dtype),
            "shape": list(value.shape),
            "values": jsonable(value.detach().cpu().reshape(-1).tolist()),
        }
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


_EXPERT = re.compile(r"^(?P<layer>(?:.*?\.)?experts)\.(?P<idx>\d+)(?:\.|$)")


_NUMBERS = re.compile(r"(\d+)")


def _natural(text: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in _NUMBERS.split(text)]


def expert_summary(fqns: Iterable[str], has_state: Callable[[str], bool]) -> list[dict[str, Any]]:
    """Per MoE layer (FQNs ``{layer}.experts.{N}.{...}``): how many experts have state.

    An expert *has state* when all its parameters do, is *partial* when some do, and is
    *without state* when none does. Layers are in natural order (``layers.2`` before ``layers.10``).
    """
    layers: dict[str, dict[int, list[bool]]] = {}
    for fqn in fqns:
        m = _EXPERT.match(fqn)
        if m is not None:
            layers.setdefault(m["layer"], {}).setdefault(int(m["idx"]), []).append(has_state(fqn))
    out = []
    for layer in sorted(layers, key=_natural):
        experts = layers[layer]
        ids = sorted(experts)
        without = [e for e in ids if not any(experts[e])]
        partial = [e for e in ids if any(experts[e]) and not all(experts[e])]
        out.append(
            {
                "layer": layer,
                "experts": len(ids),
                "with_state": len(ids) - len(without) - len(partial),
                "partial": len(partial),
                "without_state": len(without),
                "without_state_ids": without,
                "partial_ids": partial,
            }
        )
    return out


def _summarize_leaf(name: str, groups: list[Group], state_by_fqn: Mapping[str, Any], params: bool) -> dict[str, Any]:
    out_groups = []
    keys: dict[str, dict[str, Any]] = {}
    total_bytes = 0
    with_state = without = 0
    stateless: list[str] = []
    for gi, group in enumerate(groups):
        n_with = 0
        for fqn in group.fqns:
            state = state_by_fqn.get(fqn)
            if not state:
                stateless.append(fqn)
                continue
            n_with += 1
            for key, md in walk_state(state):
                info = keys.setdefault(key, {"dtypes": [], "count": 0, "bytes": 0})
                info["count"] += 1
                dtype = state_sig(md)[0]
                nbytes = item_bytes(md) if isinstance(md, TensorStorageMetadata) else _tensor_bytes(md)
                if dtype not in info["dtypes"]:
                    info["dtypes"].append(dtype)
                info["bytes"] += nbytes
                total_bytes += nbytes
        entry = {
            "index": gi,
            "settings": jsonable(group.settings),
            "params": len(group.fqns),
            "with_state": n_with,
            "without_state": len(group.fqns) - n_with,
        }
        if group.settings_vary:
            entry["settings_vary_across_tables"] = True
        out_groups.append(entry)
        with_state += n_with
        without += len(group.fqns) - n_with
    summary = {
        "name": name,
        "params": with_state + without,
        "with_state": with_state,
        "without_state": without,
        "groups": out_groups,
        "state_keys": keys,
        "state_bytes": total_bytes,
        "experts": expert_summary((f for g in groups for f in g.fqns), lambda f: bool(state_by_fqn.get(f))),
    }
    if params:
        summary["params_without_state"] = stateless
    return summary


def state_sig(md: Any) -> tuple[str, tuple[int, ...] | None]:
    """``(dtype name, shape)`` of a state value: a per-item entry's DCP metadata, or a value of a
    scalar table (a tensor, or a Python scalar: ``"object"`` like a per-item non-tensor)."""
    if isinstance(md, TensorStorageMetadata):
        return dtype_name(md.properties.dtype), tuple(md.size)
    if isinstance(md, torch.Tensor):
        return dtype_name(md.dtype), tuple(md.shape)
    return "object", None


def _tensor_bytes(value: Any) -> int:
    """Bytes of a scalar table's tensor value (0 for any other value)."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _disk_bytes(metadata: Metadata) -> dict[str, int]:
    out: dict[str, int] = {}
    storage = metadata.storage_data
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            length = getattr(info, "length", None)
            if isinstance(length, int):
                out[index.fqn] = out.get(index.fqn, 0) + length
    return out


def inspect_checkpoint(path: str | os.PathLike[str], key: str | None = None, *, params: bool = False) -> dict[str, Any]:
    """Describe every optimizer in the checkpoint at ``path`` (the ``inspect --json`` schema).

    ``params=True`` adds each leaf's ``params_without_state`` list. ``storage_problems`` lists
    items whose data file is missing or too short (file sizes only; ``verify`` reads the data).
    """
    return inspect_details(path, key, params=params)[0]


def inspect_details(
    path: str | os.PathLike[str], key: str | None = None, *, params: bool = False
) -> tuple[dict[str, Any], dict[tuple[str, str, int], dict[str, Any]]]:
    """`inspect_checkpoint`'s report, and each group's settings as Python values keyed by
    ``(optimizer key, leaf, group index)`` (for text output)."""
    raw: dict[tuple[str, str, int], dict[str, Any]] = {}
    metadata = open_checkpoint(path)
    disk = _disk_bytes(metadata)
    problems, _bad, _stats = storage_problems(path, metadata)
    found = find_optimizers(metadata)
    optimizers = []
    for opt in select_optimizers(found, key):
        values = optimizer_values(path, metadata, opt)
        leaves, flat, state_by_fqn, unmatched = split_optimizer(values)
        fmt = optimizer_format(opt, leaves, flat)
        named = named_groups(leaves, flat)
        summaries = [_summarize_leaf(name, groups, state_by_fqn, params) for name, groups in named]
        for name, groups in named:
            for gi, g in enumerate(groups):
                raw[(opt.name, name, gi)] = g.settings
        grouped = {fqn for _name, groups in named for g in groups for fqn in g.fqns}
        orphans = sorted(fqn for fqn in state_by_fqn if fqn not in grouped)
        tables = [] if opt.nested else [v for k, v in values.items() if k.startswith((PACKED_PREFIX, SCALARS_PREFIX))]
        optimizers.append(
            {
                "key": opt.name,
                "format": fmt,
                "leaves": summaries,
                "params": sum(s["params"] for s in summaries),
                "with_state": sum(s["with_state"] for s in summaries),
                "without_state": sum(s["without_state"] for s in summaries),
                "state_bytes": sum(s["state_bytes"] for s in summaries),
                "table_bytes": sum(len(t) for t in tables if isinstance(t, bytes)),
                "scalar_tables": sum(1 for k in values if k.startswith(SCALARS_PREFIX)),
                "disk_bytes": sum(disk.get(flat_key, 0) for flat_key in opt.inner.values()),
                "items": len(opt.inner),
                "state_without_group": orphans,
                "unmatched_keys": unmatched,
                "foreign_guards": len(opt.guards),
            }
        )
        optimizers[-1]["loader"] = loader_needed(optimizers[-1])
    report = {
        "checkpoint": os.fspath(path),
        "optimizers": optimizers,
        "unrecognised_optimizer_items": unrecognised_optimizer_items(metadata, found),
        "storage_problems": problems,
    }
    return report, raw


# --------------------------------------------------------------------------- text form


LIST_LIMIT = 10
"""How many names a text report line lists before ``(+N more)``."""


def fmt_value(value: Any) -> str:
    """A settings value for a text report (a tensor by its value or shape, and dtype)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({value.item()!r}, {dtype_name(value.dtype)})"
        return f"tensor(shape={tuple(value.shape)}, {dtype_name(value.dtype)})"
    return repr(value)


def fmt_names(items: Sequence[Any], limit: int = LIST_LIMIT) -> str:
    """The first ``limit`` of ``items`` (repr), then ``(+N more)``."""
    return first_n(items, limit, show=repr)


def id_ranges(ids: Sequence[int]) -> str:
    """Expert ids with runs of consecutive ids as ranges: ``0-3, 7, 9-199`` (text output only;
    ``--json`` lists every id)."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(parts)


def _expert_lines(experts: list[dict[str, Any]], params: bool) -> list[str]:
    if not experts:
        return []
    total = sum(e["experts"] for e in experts)
    with_state = sum(e["with_state"] for e in experts)
    partial = sum(e["partial"] for e in experts)
    ratios = sorted((e["with_state"], e["experts"]) for e in experts)
    lo, hi = ratios[0], ratios[-1]
    span = f"{lo[0]}/{lo[1]}" if lo == hi else f"{lo[0]}/{lo[1]} to {hi[0]}/{hi[1]}"
    extra = f", {partial} partial" if partial else ""
    lines = [
        (
            f"    experts with state: {with_state}/{total} in {len(experts)} layer(s) "
            f"(per layer: {span}{extra}; FQNs '...experts.N...')"
        )
    ]
    if params:
        width = max(len(e["layer"]) for e in experts)
        for e in experts:
            line = f"      {e['layer']:<{width}}  {e['with_state']}/{e['experts']} with state"
            if e["partial"]:
                line += f", partial: {id_ranges(e['partial_ids'])}"
            if e["without_state"]:
                line += f"; without state: {id_ranges(e['without_state_ids'])}"
            lines.append(line)
    return lines


def _scalar_note(opt: Mapping[str, Any]) -> str:
    """`` (N scalar table(s))`` for a packed version-2 optimizer, else empty."""
    n = opt.get("scalar_tables", 0)
    return f" ({n} scalar table{'s' if n != 1 else ''})" if n else ""


_FORMATS = {"nested": "torch DSD nested (its groups read as leaf 'optim')"}
"""How the text report names a format (the ``--json`` report has the short name)."""


def format_inspect(report: dict[str, Any], groups_raw: dict[tuple[str, str, int], dict[str, Any]]) -> str:
    """The text form of an ``inspect`` report."""
    lines = [f"checkpoint: {report['checkpoint']}"]
    odd = report.get("unrecognised_optimizer_items", [])
    if not report["optimizers"] and not odd:
        lines.append("no optimizer entries found (no '<key>.state.*' / '<key>.param_groups.*' entries)")
    for opt in report["optimizers"]:
        key = opt["key"] or "(top level)"
        lines.append(
            f"optimizer {key!s}: {_FORMATS.get(opt['format'], opt['format'])} format, {len(opt['leaves'])} "
            f"leaf/leaves, {opt['params']} params "
            f"({opt['with_state']} with state, {opt['without_state']} without), {opt['items']} items, "
            f"state {opt['state_bytes']} bytes, tables {opt['table_bytes']} bytes{_scalar_note(opt)}, "
            f"on disk {opt['disk_bytes']} bytes"
        )
        lines.append(f"  loads with {opt['loader']}")
        for leaf in opt["leaves"]:
            lines.append(
                f"  leaf {leaf['name']!r}: {len(leaf['groups'])} group(s), {leaf['params']} params "
                f"({leaf['with_state']} with state, {leaf['without_state']} without), "
                f"state {leaf['state_bytes']} bytes"
            )
            for group in leaf["groups"]:
                raw = groups_raw.get((opt["key"], leaf["name"], group["index"]), {})
                settings = ", ".join(f"{k}={fmt_value(v)}" for k, v in raw.items())
                vary = "  [settings differ across ranks' tables]" if group.get("settings_vary_across_tables") else ""
                lines.append(
                    f"    group {group['index']}: {group['params']} params ({group['with_state']} with state, "
                    f"{group['without_state']} without){vary}"
                )
                lines.append(f"      {settings}")
            for name, info in leaf["state_keys"].items():
                lines.append(f"    state {name}: {'/'.join(info['dtypes'])} x{info['count']}, {info['bytes']} bytes")
            params = "params_without_state" in leaf
            lines.extend(_expert_lines(leaf["experts"], params))
            if params:
                lines.append(f"    parameters without state ({len(leaf['params_without_state'])}):")
                lines.extend(f"      {fqn}" for fqn in leaf["params_without_state"])
        if opt["state_without_group"]:
            lines.append(f"  state of {len(opt['state_without_group'])} FQN(s) in no group")
        if opt["unmatched_keys"]:
            lines.append(f"  {len(opt['unmatched_keys'])} unrecognised key(s)")
    if odd:
        lines.append(
            f"{len(odd)} item(s) look like optimizer state or settings but are in no layout sparse_ckpt reads "
            f"(sparse packed/flat, or torch DSD's nested 'state'/'param_groups'): {fmt_names(odd)}"
        )
    for p in report.get("storage_problems", []):
        lines.append(f"storage problem: {p['key']}: {p['problem']}")
    return "\n".join(lines)
