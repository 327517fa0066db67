"""``python -m sparse_ckpt``: inspect and convert the optimizer part of DCP checkpoints.

``inspect CKPT_DIR [--key K] [--json]``
    Per optimizer (auto-detected: entries under ``<key>.state.*`` / ``<key>.param_groups.*``) and
    per leaf: the groups with their settings, how many parameters have state and how many do not,
    the state keys with their dtypes, and the bytes they take.

``convert SRC DST --to packed|flat [--key K] [--leaf NAME] [--drop-empty-groups]``
    Rewrite the optimizer part between formats; every other entry is copied unchanged. State
    keys are identical in both formats; only the param-group entries change. Flat format stores
    neither leaf names nor group boundaries, so flat -> packed writes one leaf (``--leaf``,
    default ``optim``, the name of a single optimizer) with one group per distinct settings, in
    order of first appearance; loading matches by FQN, so the result loads into any leaf layout.
    Groups without parameters cannot be expressed in flat format: packed -> flat refuses them
    unless ``--drop-empty-groups``. The whole checkpoint is read into memory (one process).

Exit status: 0 success, 1 checkpoint/format error, 2 usage error or a directory that is not a
(complete) DCP checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from . import _backend
from ._tensor_parts import parts_to_tensor, tensor_to_parts
from .checkpoint_io import (
    NotACheckpointError,
    OptimizerEntries,
    find_optimizers,
    load_entries,
    metadata_path,
    read_metadata,
    set_path,
)
from .errors import CheckpointFormatError, CheckpointMismatchError, SparseCheckpointError
from .format import ESCAPE, PACKED_PREFIX, packed_table_key, split_table_key, table_digest
from .leaves import SINGLE_LEAF

_PACKED_PREFIX = PACKED_PREFIX
_FLAT_LEAF_IN_MIXED = "(flat entries)"


class UsageError(Exception):
    """A bad command line or destination (exit status 2)."""


# --------------------------------------------------------------------------- decoding


class _Group:
    def __init__(self, settings: dict[str, Any], blob: bytes) -> None:
        self.settings = settings
        self.blob = blob
        self.fqns: list[str] = []
        self.settings_vary = False


def _decode_tables(values: Mapping[str, Any]) -> dict[str, list[_Group]]:
    """Packed tables -> ``leaf -> groups`` (tables of one leaf merged by group index)."""
    core = _backend.core
    leaves: dict[str, list[_Group]] = {}
    for inner, table in values.items():
        if not inner.startswith(_PACKED_PREFIX):
            continue
        if not isinstance(table, bytes):
            raise CheckpointFormatError(f"packed group table {inner!r} is a {type(table).__name__}, expected bytes")
        leaf, digest = split_table_key(inner[len(_PACKED_PREFIX) :])
        if table_digest(table) != digest:
            raise CheckpointFormatError(f"leaf {leaf!r}: group table {inner!r} does not match its digest")
        settings, blobs, groups = core.decode_table(leaf, table, parts_to_tensor)
        merged = leaves.setdefault(leaf, [])
        for gi, (idx, fqns) in enumerate(groups):
            if gi == len(merged):
                merged.append(_Group(settings[idx], blobs[idx]))
            elif merged[gi].blob != blobs[idx]:
                merged[gi].settings_vary = True
            merged[gi].fqns.extend(fqns)
    return leaves


def _flat_groups(settings_by_fqn: Mapping[str, dict[str, Any]]) -> list[_Group]:
    """Flat settings -> one group per distinct settings, in order of first appearance."""
    core = _backend.core
    groups: dict[bytes, _Group] = {}
    for fqn, raw in settings_by_fqn.items():
        blob = core.encode_settings(f"flat:{fqn}", 0, raw, torch.Tensor, tensor_to_parts)
        group = groups.get(blob)
        if group is None:
            group = groups[blob] = _Group(raw, blob)
        group.fqns.append(fqn)
    return list(groups.values())


def _split_optimizer(values: Mapping[str, Any]) -> tuple[dict[str, list[_Group]], list[_Group], dict, list[str]]:
    """``(packed leaves, flat groups, state_by_fqn, unmatched keys)`` of one optimizer's entries."""
    leaves = _decode_tables(values)
    known = {fqn: fqn for groups in leaves.values() for g in groups for fqn in g.fqns}
    settings_by_fqn, state_by_fqn, _tables, unmatched = _backend.core.unflatten(values, known)
    return leaves, _flat_groups(settings_by_fqn), state_by_fqn, list(unmatched)


# --------------------------------------------------------------------------- inspect


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _walk_state(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in node.items():
        if isinstance(value, dict):
            out.extend(_walk_state(value, f"{prefix}{key}."))
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return {
            "tensor": _dtype_name(value.dtype),
            "shape": list(value.shape),
            "values": _jsonable(value.detach().cpu().reshape(-1).tolist()),
        }
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _summarize_leaf(name: str, groups: list[_Group], state_by_fqn: Mapping[str, Any]) -> dict[str, Any]:
    out_groups = []
    keys: dict[str, dict[str, Any]] = {}
    total_bytes = 0
    with_state = without = 0
    for gi, group in enumerate(groups):
        n_with = 0
        for fqn in group.fqns:
            state = state_by_fqn.get(fqn)
            if not state:
                continue
            n_with += 1
            for key, md in _walk_state(state):
                info = keys.setdefault(key, {"dtypes": [], "count": 0, "bytes": 0})
                info["count"] += 1
                if isinstance(md, TensorStorageMetadata):
                    dtype = _dtype_name(md.properties.dtype)
                    nbytes = math.prod(md.size) * md.properties.dtype.itemsize
                else:
                    dtype, nbytes = "object", 0
                if dtype not in info["dtypes"]:
                    info["dtypes"].append(dtype)
                info["bytes"] += nbytes
                total_bytes += nbytes
        entry = {
            "index": gi,
            "settings": _jsonable(group.settings),
            "params": len(group.fqns),
            "with_state": n_with,
            "without_state": len(group.fqns) - n_with,
        }
        if group.settings_vary:
            entry["settings_vary_across_tables"] = True
        out_groups.append(entry)
        with_state += n_with
        without += len(group.fqns) - n_with
    return {
        "name": name,
        "params": with_state + without,
        "with_state": with_state,
        "without_state": without,
        "groups": out_groups,
        "state_keys": keys,
        "state_bytes": total_bytes,
    }


def _disk_bytes(metadata: Metadata) -> dict[str, int]:
    out: dict[str, int] = {}
    storage = metadata.storage_data
    if isinstance(storage, Mapping):
        for index, info in storage.items():
            length = getattr(info, "length", None)
            if isinstance(length, int):
                out[index.fqn] = out.get(index.fqn, 0) + length
    return out


def inspect_checkpoint(path: str, key: str | None = None) -> dict[str, Any]:
    """Describe every optimizer in the checkpoint at ``path`` (the ``--json`` schema)."""
    return _inspect(path, key)[0]


def _inspect(path: str, key: str | None) -> tuple[dict[str, Any], dict[tuple[str, str, int], dict[str, Any]]]:
    """The report, and each group's settings as Python values keyed by (optimizer, leaf, group index)."""
    raw: dict[tuple[str, str, int], dict[str, Any]] = {}
    metadata = read_metadata(path)
    disk = _disk_bytes(metadata)
    optimizers = []
    for opt in _select(find_optimizers(metadata), key):
        pg = {inner: flat for inner, flat in opt.inner.items() if not inner.startswith("state.")}
        loaded = load_entries(path, metadata, pg.values())
        values: dict[str, Any] = {inner: loaded[flat] for inner, flat in pg.items()}
        for inner, flat in opt.inner.items():
            if inner.startswith("state."):
                values[inner] = metadata.state_dict_metadata[flat]
        leaves, flat_groups, state_by_fqn, unmatched = _split_optimizer(values)
        fmt = "mixed" if leaves and flat_groups else "packed" if leaves else "flat"
        named = list(leaves.items())
        if flat_groups:
            named.append((_FLAT_LEAF_IN_MIXED if leaves else SINGLE_LEAF, flat_groups))
        summaries = [_summarize_leaf(name, groups, state_by_fqn) for name, groups in named]
        for name, groups in named:
            for gi, g in enumerate(groups):
                raw[(opt.name, name, gi)] = g.settings
        grouped = {fqn for _name, groups in named for g in groups for fqn in g.fqns}
        orphans = sorted(fqn for fqn in state_by_fqn if fqn not in grouped)
        table_bytes = sum(len(v) for k, v in values.items() if k.startswith(_PACKED_PREFIX))
        optimizers.append(
            {
                "key": opt.name,
                "format": fmt,
                "leaves": summaries,
                "params": sum(s["params"] for s in summaries),
                "with_state": sum(s["with_state"] for s in summaries),
                "without_state": sum(s["without_state"] for s in summaries),
                "state_bytes": sum(s["state_bytes"] for s in summaries),
                "table_bytes": table_bytes,
                "disk_bytes": sum(disk.get(flat, 0) for flat in opt.inner.values()),
                "items": len(opt.inner),
                "state_without_group": orphans,
                "unmatched_keys": unmatched,
            }
        )
    return {"checkpoint": os.fspath(path), "optimizers": optimizers}, raw


def _fmt_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({value.item()!r}, {_dtype_name(value.dtype)})"
        return f"tensor(shape={tuple(value.shape)}, {_dtype_name(value.dtype)})"
    return repr(value)


def _format_text(report: dict[str, Any], groups_raw: dict[tuple[str, str, int], dict[str, Any]]) -> str:
    lines = [f"checkpoint: {report['checkpoint']}"]
    if not report["optimizers"]:
        lines.append("no optimizer entries found (no '<key>.state.*' / '<key>.param_groups.*' entries)")
    for opt in report["optimizers"]:
        key = opt["key"] or "(top level)"
        lines.append(
            f"optimizer {key!s}: {opt['format']} format, {len(opt['leaves'])} leaf/leaves, {opt['params']} params "
            f"({opt['with_state']} with state, {opt['without_state']} without), {opt['items']} items, "
            f"state {opt['state_bytes']} bytes, tables {opt['table_bytes']} bytes, on disk {opt['disk_bytes']} bytes"
        )
        for leaf in opt["leaves"]:
            lines.append(
                f"  leaf {leaf['name']!r}: {len(leaf['groups'])} group(s), {leaf['params']} params "
                f"({leaf['with_state']} with state, {leaf['without_state']} without), "
                f"state {leaf['state_bytes']} bytes"
            )
            for group in leaf["groups"]:
                raw = groups_raw.get((opt["key"], leaf["name"], group["index"]), {})
                settings = ", ".join(f"{k}={_fmt_value(v)}" for k, v in raw.items())
                vary = "  [settings differ across ranks' tables]" if group.get("settings_vary_across_tables") else ""
                lines.append(
                    f"    group {group['index']}: {group['params']} params ({group['with_state']} with state, "
                    f"{group['without_state']} without){vary}"
                )
                lines.append(f"      {settings}")
            for name, info in leaf["state_keys"].items():
                lines.append(
                    f"    state {name}: {'/'.join(info['dtypes'])} x{info['count']}, {info['bytes']} bytes"
                )
        if opt["state_without_group"]:
            lines.append(f"  state of {len(opt['state_without_group'])} FQN(s) in no group")
        if opt["unmatched_keys"]:
            lines.append(f"  {len(opt['unmatched_keys'])} unrecognised key(s)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- convert


def _select(found: list[OptimizerEntries], key: str | None) -> list[OptimizerEntries]:
    if key is None:
        return found
    chosen = [opt for opt in found if opt.name == key]
    if not chosen:
        names = ", ".join(repr(o.name) for o in found) or "none"
        raise UsageError(f"no optimizer entries under key {key!r} (found: {names})")
    return chosen


def convert_optimizer(
    values: Mapping[str, Any], to: str, *, leaf: str = SINGLE_LEAF, drop_empty_groups: bool = False
) -> dict[str, Any]:
    """One optimizer's entries rewritten in format ``to``; state and unknown entries are kept."""
    core = _backend.core
    leaves, flat_groups, _state, _unmatched = _split_optimizer(values)
    out = {k: v for k, v in values.items() if not k.startswith("param_groups.")}
    if to == "flat":
        escaped = [k for k in values if k.startswith("state.") and f".{ESCAPE}" in k]
        if escaped and leaves:
            raise CheckpointFormatError(
                f"state key {escaped[0]!r} has an escaped part (a state key that is not a plain str, or nested "
                "state that reads as another FQN): the flat layout cannot hold it"
            )
        seen: dict[str, bytes] = {}
        for name, groups in leaves.items():
            for gi, group in enumerate(groups):
                if not group.fqns:
                    if drop_empty_groups:
                        continue
                    raise CheckpointMismatchError(
                        f"leaf {name!r} group {gi} has no parameters; flat format cannot express it "
                        "(pass --drop-empty-groups to drop it)"
                    )
                if group.settings_vary:
                    raise CheckpointMismatchError(
                        f"leaf {name!r} group {gi}: ranks' tables hold different settings for this group"
                    )
                for fqn in group.fqns:
                    prev = seen.setdefault(fqn, group.blob)
                    if prev != group.blob:
                        raise CheckpointMismatchError(f"conflicting saved settings for parameter {fqn!r}")
                out.update(core.flatten_groups(name, [(group.settings, group.fqns)]))
        for group in flat_groups:
            out.update(core.flatten_groups(_FLAT_LEAF_IN_MIXED, [(group.settings, group.fqns)]))
    elif to == "packed":
        for key, value in values.items():
            if key.startswith(_PACKED_PREFIX):
                out[key] = value
        if flat_groups:
            if leaf in leaves:
                raise UsageError(f"leaf {leaf!r} already has packed tables; pick another --leaf")
            groups_fqn = [(g.settings, g.fqns) for g in flat_groups]
            table = core.encode_table(leaf, groups_fqn, torch.Tensor, tensor_to_parts)
            out[packed_table_key(leaf, table)] = table
    else:
        raise UsageError(f"--to must be 'packed' or 'flat', got {to!r}")
    return out


def convert_checkpoint(
    src: str,
    dst: str,
    to: str,
    *,
    key: str | None = None,
    leaf: str = SINGLE_LEAF,
    drop_empty_groups: bool = False,
) -> list[str]:
    """Write ``src`` to ``dst`` with its optimizer part in format ``to``; returns the keys converted."""
    metadata = read_metadata(src)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("SRC and DST must differ")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise UsageError(f"destination {dst!r} exists and is not an empty directory")
    opts = _select(find_optimizers(metadata), key)
    if not opts:
        raise UsageError(f"{src!r} holds no optimizer entries ('<key>.state.*' / '<key>.param_groups.*')")
    everything = load_entries(src, metadata, metadata.state_dict_metadata.keys())
    converted = {flat for opt in opts for flat in opt.inner.values()}
    new_opts = []
    for opt in opts:
        values = {inner: everything[flat] for inner, flat in opt.inner.items()}
        new_opts.append((opt.prefix, convert_optimizer(values, to, leaf=leaf, drop_empty_groups=drop_empty_groups)))
    nested: dict[str, Any] = {}
    for flat, value in everything.items():
        if flat not in converted:
            set_path(nested, metadata_path(metadata, flat), value)
    for prefix, entries in new_opts:
        for inner, value in entries.items():
            set_path(nested, (*prefix, inner), value)
    os.makedirs(dst, exist_ok=True)
    dcp.save(nested, checkpoint_id=dst, no_dist=True)
    return [opt.name for opt in opts]


# --------------------------------------------------------------------------- entry point


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sparse_ckpt", description="Inspect and convert sparse_ckpt optimizer state in DCP checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe the optimizer state of a checkpoint")
    p.add_argument("checkpoint", help="DCP checkpoint directory")
    p.add_argument("--key", help="the optimizer's key in the checkpoint (default: every one detected)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    c = sub.add_parser("convert", help="rewrite the optimizer part between packed and flat format")
    c.add_argument("src", help="source DCP checkpoint directory")
    c.add_argument("dst", help="destination directory (new or empty)")
    c.add_argument("--to", required=True, choices=("packed", "flat"), help="target format")
    c.add_argument("--key", help="the optimizer's key in the checkpoint (default: every one detected)")
    c.add_argument("--leaf", default=SINGLE_LEAF, help="leaf name for flat -> packed (default: %(default)s)")
    c.add_argument(
        "--drop-empty-groups", action="store_true", help="packed -> flat: drop groups without parameters"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            report, raw = _inspect(args.checkpoint, args.key)
            print(json.dumps(report, indent=2) if args.json else _format_text(report, raw))
        else:
            keys = convert_checkpoint(
                args.src, args.dst, args.to, key=args.key, leaf=args.leaf, drop_empty_groups=args.drop_empty_groups
            )
            shown = ", ".join(repr(k or "(top level)") for k in keys)
            print(f"wrote {args.dst}: optimizer {shown} in {args.to} format")
    except (NotACheckpointError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SparseCheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
