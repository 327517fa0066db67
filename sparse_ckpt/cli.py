"""``python -m sparse_ckpt``: inspect, verify, diff, convert and export the optimizer part of DCP checkpoints.

``inspect CKPT [--key K] [--params] [--json]``
    Per optimizer (auto-detected: entries under ``<key>.state.*`` / ``<key>.param_groups.*``) and
    per leaf: the groups with their settings, how many parameters have state and how many do not,
    the state keys with their dtypes, the bytes they take, and for MoE FQNs (``...experts.N...``)
    how many experts per layer have state. ``--params`` lists the parameters without state and
    the per-layer expert table. Scalars held in a packed checkpoint's scalar tables (``step``, ...)
    count as state exactly like per-item entries; the optimizer line says how many scalar tables
    there are. Items whose data file is missing or too short make it exit 1.

``verify CKPT [--json]``
    Read every item (storage bounds, zip CRC-32, then through DCP) and decode every optimizer;
    list what is missing, truncated or corrupt. Exit 1 when anything is wrong.

``diff A B [--key K] [--json] [--exit-code]``
    Per leaf: groups whose settings changed, parameters that gained or lost state or moved
    between groups, state dtype/shape changes. ``--exit-code``: exit 3 when they differ.

``convert SRC DST --to packed|flat [--key K] [--leaf NAME] [--drop-empty-groups]``
    Rewrite the optimizer part between formats; every other entry is copied unchanged.

``export CKPT OUT [--key K] [--leaf NAME]``
    Write the optimizer part as safetensors + JSON, no pickle (see :mod:`sparse_ckpt.export`).

The work is done by :mod:`sparse_ckpt.checkpoint_tools` and :mod:`sparse_ckpt.export`; this
module parses arguments and prints. Exit status: 0 success, 1 checkpoint/format error (one line
on stderr, no traceback), 2 usage error or a directory that is not a (complete) DCP checkpoint,
3 ``diff --exit-code`` found differences. Output into a pipe closed early (``| head``) ends
quietly with exit 1, as the "Note on SIGPIPE" in Python's :mod:`signal` documentation recommends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from . import _backend
from ._version import __version__
from .checkpoint_io import NotACheckpointError
from .checkpoint_tools import (
    UsageError,
    convert_checkpoint,
    diff_checkpoints,
    dtype_name,
    inspect_details,
    jsonable,
    verify_checkpoint,
)
from .errors import SparseCheckpointError
from .leaves import SINGLE_LEAF

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DIFFERENT = 0, 1, 2, 3
_LIST_LIMIT = 10


def _fmt_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"tensor({value.item()!r}, {dtype_name(value.dtype)})"
        return f"tensor(shape={tuple(value.shape)}, {dtype_name(value.dtype)})"
    return repr(value)


def _fmt_names(items: Sequence[Any], limit: int = _LIST_LIMIT) -> str:
    shown = ", ".join(repr(x) for x in items[:limit])
    return f"{shown} (+{len(items) - limit} more)" if len(items) > limit else shown


def _ids(ids: Sequence[int]) -> str:
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


# --------------------------------------------------------------------------- inspect


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
        (f"    experts with state: {with_state}/{total} in {len(experts)} layer(s) "
        f"(per layer: {span}{extra}; FQNs '...experts.N...')")
    ]
    if params:
        width = max(len(e["layer"]) for e in experts)
        for e in experts:
            line = f"      {e['layer']:<{width}}  {e['with_state']}/{e['experts']} with state"
            if e["partial"]:
                line += f", partial: {_ids(e['partial_ids'])}"
            if e["without_state"]:
                line += f"; without state: {_ids(e['without_state_ids'])}"
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
            f"optimizer {key!s}: {_FORMATS.get(opt['format'], opt['format'])} format, {len(opt['leaves'])} leaf/leaves, {opt['params']} params "
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
                settings = ", ".join(f"{k}={_fmt_value(v)}" for k, v in raw.items())
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
            f"(sparse packed/flat, or torch DSD's nested 'state'/'param_groups'): {_fmt_names(odd)}"
        )
    for p in report.get("storage_problems", []):
        lines.append(f"storage problem: {p['key']}: {p['problem']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- verify


def format_verify(report: dict[str, Any]) -> str:
    """The text form of a ``verify`` report."""
    lines = [
        f"checkpoint: {report['checkpoint']}",
        (f"{report['items']} item(s) in {report['files']} file(s), {report['bytes']} bytes; "
        f"{report['read']} read; optimizers: {', '.join(repr(o or '(top level)') for o in report['optimizers']) or 'none'}"),
    ]
    for name, loader in report.get("loaders", {}).items():
        lines.append(f"optimizer {name or '(top level)'!r} loads with {loader}")
    if report["crc_unchecked"]:
        lines.append(f"{report['crc_unchecked']} item part(s) without a CRC-32 (read, not checksummed)")
    for p in report["problems"]:
        lines.append(f"problem: {p['key']}: {p['problem']}")
    lines.append("OK" if report["ok"] else f"{len(report['problems'])} problem(s)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- diff


def _sig(s: dict[str, Any] | None) -> str:
    if s is None:
        return "absent"
    return s["dtype"] if s["shape"] is None else f"{s['dtype']} {tuple(s['shape'])}"


def format_diff(report: dict[str, Any]) -> str:
    """The text form of a ``diff`` report."""
    lines = [f"a: {report['a']}", f"b: {report['b']}"]
    for name in report["optimizers_only_in_a"]:
        lines.append(f"optimizer {name or '(top level)'}: only in a")
    for name in report["optimizers_only_in_b"]:
        lines.append(f"optimizer {name or '(top level)'}: only in b")
    for opt in report["optimizers"]:
        ka, kb = opt["key_a"] or "(top level)", opt["key_b"] or "(top level)"
        lines.append(f"optimizer {ka}" + (f" -> {kb}:" if ka != kb else ":"))
        for leaf in opt["leaves"]:
            where = f"  leaf {leaf['name']!r}"
            if "only_in" in leaf:
                lines.append(f"{where}: only in {leaf['only_in']} ({leaf['groups']} group(s), {leaf['params']} params)")
                continue
            for g in leaf.get("groups", []):
                gw = f"{where} group {g['index']}"
                if "only_in" in g:
                    lines.append(f"{gw}: only in {g['only_in']} ({g['params']} params)")
                    continue
                s = g.get("settings", {})
                for k, (va, vb) in s.get("changed", {}).items():
                    lines.append(f"{gw}: {k} {_fmt_value(va)} -> {_fmt_value(vb)}")
                for k, v in s.get("removed", {}).items():
                    lines.append(f"{gw}: {k} removed (was {_fmt_value(v)})")
                for k, v in s.get("added", {}).items():
                    lines.append(f"{gw}: {k} added ({_fmt_value(v)})")
                if g.get("params_added"):
                    lines.append(f"{gw}: +{len(g['params_added'])} param(s): {_fmt_names(g['params_added'])}")
                if g.get("params_removed"):
                    lines.append(f"{gw}: -{len(g['params_removed'])} param(s): {_fmt_names(g['params_removed'])}")
            if leaf.get("gained_state"):
                lines.append(f"{where}: {len(leaf['gained_state'])} param(s) gained state: {_fmt_names(leaf['gained_state'])}")
            if leaf.get("lost_state"):
                lines.append(f"{where}: {len(leaf['lost_state'])} param(s) lost state: {_fmt_names(leaf['lost_state'])}")
            changes = leaf.get("state_changes", [])
            for c in changes[:_LIST_LIMIT]:
                lines.append(f"{where}: state {c['key']} of {c['fqn']!r}: {_sig(c['a'])} -> {_sig(c['b'])}")
            if len(changes) > _LIST_LIMIT:
                lines.append(f"{where}: ... {len(changes) - _LIST_LIMIT} more state change(s)")
        if opt.get("params_only_in_a"):
            lines.append(f"  {len(opt['params_only_in_a'])} param(s) only in a: {_fmt_names(opt['params_only_in_a'])}")
        if opt.get("params_only_in_b"):
            lines.append(f"  {len(opt['params_only_in_b'])} param(s) only in b: {_fmt_names(opt['params_only_in_b'])}")
    n = report["differences"]
    lines.append("no differences" if n == 0 else f"{n} difference(s)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry point


def _version() -> str:
    return f"sparse_ckpt {__version__} (torch {torch.__version__}, core {_backend.NAME})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sparse_ckpt",
        description="Inspect, verify, diff, convert and export sparse_ckpt optimizer state in DCP checkpoints.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    key_help = "the optimizer's key in the checkpoint (default: every one detected)"
    p = sub.add_parser("inspect", help="describe the optimizer state of a checkpoint")
    p.add_argument("checkpoint", help="DCP checkpoint directory")
    p.add_argument("--key", help=key_help)
    p.add_argument("--params", action="store_true", help="list parameters without state and experts per layer")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    v = sub.add_parser("verify", help="read every item and report missing, truncated or corrupt ones")
    v.add_argument("checkpoint", help="DCP checkpoint directory")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    d = sub.add_parser("diff", help="compare the optimizer parts of two checkpoints")
    d.add_argument("a", help="first DCP checkpoint directory")
    d.add_argument("b", help="second DCP checkpoint directory")
    d.add_argument("--key", help="the optimizer's key in both (default: the only one, or equal keys)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--exit-code", action="store_true", help=f"exit {EXIT_DIFFERENT} when they differ")
    c = sub.add_parser("convert", help="rewrite the optimizer part between packed and flat format")
    c.add_argument("src", help="source DCP checkpoint directory")
    c.add_argument("dst", help="destination directory (new or empty)")
    c.add_argument("--to", required=True, choices=("packed", "flat"), help="target format")
    c.add_argument("--key", help=key_help)
    c.add_argument("--leaf", default=SINGLE_LEAF, help="leaf name for flat -> packed (default: %(default)s)")
    c.add_argument("--drop-empty-groups", action="store_true", help="packed -> flat: drop groups without parameters")
    e = sub.add_parser("export", help="write the optimizer part as safetensors + JSON (no pickle)")
    e.add_argument("checkpoint", help="DCP checkpoint directory")
    e.add_argument("out", help="destination directory (new or empty)")
    e.add_argument("--key", help="the optimizer's key (default: the checkpoint's only optimizer)")
    e.add_argument("--leaf", default=SINGLE_LEAF, help="leaf name for flat-format settings (default: %(default)s)")
    return parser


def _run(args: argparse.Namespace, out: Callable[[str], None], err: Callable[[str], None]) -> int:
    if args.command == "inspect":
        report, raw = inspect_details(args.checkpoint, args.key, params=args.params)
        out(json.dumps(report, indent=2) if args.json else format_inspect(report, raw))
        if not report["optimizers"] and report["unrecognised_optimizer_items"]:
            err("error: optimizer-like items in a layout sparse_ckpt does not read (listed above)")
            return EXIT_ERROR
        if report["storage_problems"]:
            n = len(report["storage_problems"])
            err(f"error: {n} storage problem(s) (missing or truncated data); run `python -m sparse_ckpt verify`")
            return EXIT_ERROR
        return EXIT_OK
    if args.command == "verify":
        report = verify_checkpoint(args.checkpoint)
        out(json.dumps(report, indent=2) if args.json else format_verify(report))
        return EXIT_OK if report["ok"] else EXIT_ERROR
    if args.command == "diff":
        report = diff_checkpoints(args.a, args.b, args.key)
        out(json.dumps(jsonable(report), indent=2) if args.json else format_diff(report))
        return EXIT_DIFFERENT if args.exit_code and report["differences"] else EXIT_OK
    if args.command == "convert":
        keys = convert_checkpoint(
            args.src, args.dst, args.to, key=args.key, leaf=args.leaf, drop_empty_groups=args.drop_empty_groups
        )
        shown = ", ".join(repr(k or "(top level)") for k in keys)
        out(f"wrote {args.dst}: optimizer {shown} in {args.to} format")
        return EXIT_OK
    from .export import export_checkpoint  # safetensors is needed only here

    s = export_checkpoint(args.checkpoint, args.out, args.key, leaf=args.leaf)
    out(
        f"wrote {s.out_dir}: optimizer {s.key or '(top level)'!r} ({s.source_format}), leaves {s.leaves}, "
        f"{s.tensors} state tensor(s) ({s.tensor_bytes} bytes), {s.tables} table(s) ({s.table_bytes} bytes), "
        f"{s.values} JSON value(s); {s.file_bytes} bytes on disk in {s.seconds:.2f} s"
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status. Errors are one line on stderr, never a traceback."""
    args = _parser().parse_args(argv)

    def out(text: str) -> None:
        text += "\n"
        for i in range(0, len(text), 1 << 16):  # pieces: a reader that went away is noticed early
            sys.stdout.write(text[i : i + (1 << 16)])
        sys.stdout.flush()

    def err(text: str) -> None:
        print(text, file=sys.stderr)

    try:
        return _run(args, out, err)
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly; point stdout at devnull so the
        # interpreter's final flush does not raise again, and exit 1 (the recipe of the "Note on
        # SIGPIPE" in Python's signal module documentation: Python exits 1 on EPIPE).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return EXIT_ERROR
    except (NotACheckpointError, UsageError) as exc:
        err(f"error: {exc}")
        return EXIT_USAGE
    except (SparseCheckpointError, OSError, ImportError) as exc:
        err(f"error: {_first_line(exc)}")
        return EXIT_ERROR
    except CheckpointException as exc:  # a BaseException: DCP failed outside sparse_ckpt's readers
        failures = getattr(exc, "failures", {}) or {}
        inner = next(iter(failures.values()))[0] if failures else exc
        err(f"error: cannot read checkpoint: {type(inner).__name__}: {_first_line(inner)}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        err("interrupted")
        return 130


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
