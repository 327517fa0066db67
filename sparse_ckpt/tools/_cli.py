"""``python -m sparse_ckpt``: inspect, verify, diff, convert and export the optimizer part of DCP checkpoints;
``run`` is ``sparse-ckpt-run`` (`sparse_ckpt.launcher`, docs/launcher.md).

The commands, their options, output and exit statuses are documented in docs/cli.md. The work is
done by `sparse_ckpt.tools` and `sparse_ckpt.tools.export`; this module parses arguments
and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch.distributed.checkpoint import CheckpointException

from .. import _backend
from .._leaves import SINGLE_LEAF
from .._version import __version__
from ..errors import NotACheckpointError, SparseCheckpointError, UsageError
from . import convert_checkpoint, diff_checkpoints, verify_checkpoint
from .diff import format_diff
from .inspect import format_inspect, inspect_details, jsonable
from .verify import format_verify

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DIFFERENT = 0, 1, 2, 3


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
    c.add_argument("--fqns", metavar="FILE",
                   help="a torch optimizer.state_dict() (int ids): its parameters' FQNs, one per line, in the optimizer's order")
    e = sub.add_parser("export", help="write the optimizer part as safetensors + JSON (no pickle)")
    e.add_argument("checkpoint", help="DCP checkpoint directory")
    e.add_argument("out", help="destination directory (new or empty)")
    e.add_argument("--key", help="the optimizer's key (default: the checkpoint's only optimizer)")
    e.add_argument("--leaf", default=SINGLE_LEAF, help="leaf name for flat-format settings (default: %(default)s)")
    r = sub.add_parser(
        "run", add_help=False, help="run a command with sparse_ckpt active in every Python process it starts (sparse-ckpt-run)"
    )
    r.add_argument("args", nargs=argparse.REMAINDER, help="sparse-ckpt-run's options and the command")
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
            args.src, args.dst, args.to, key=args.key, leaf=args.leaf, drop_empty_groups=args.drop_empty_groups,
            fqns=_read_fqns(args.fqns),
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


def _read_fqns(path: str | None) -> list[str] | None:
    """``--fqns FILE``: its non-empty lines."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except OSError as exc:
        raise UsageError(f"--fqns: cannot read {path!r}: {exc.strerror}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status. Errors are one line on stderr, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # everything after "run" is sparse-ckpt-run's (argparse would read its options)
        from ..launcher.cli import main as run_main

        return run_main(argv[1:])
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
