"""``python -m sparse_ckpt``: inspect, verify, diff, convert and export the optimizer part of DCP checkpoints;
``run`` is ``sparse-ckpt-run`` (`sparse_ckpt.launcher`, docs/launcher.md).

The commands, their options, output and exit statuses are documented in docs/cli.md. The work is
done by `sparse_ckpt.tools` and `sparse_ckpt.tools.export`; this module parses arguments
and prints. It imports neither torch nor the tools at module level: ``--help``, ``--version`` and
usage errors start no torch, and each command imports only the tool it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence

from .._version import __version__

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DIFFERENT = 0, 1, 2, 3


QUIET_WARNINGS = (r"torch\.distributed is disabled, unavailable or uninitialized",)
"""Messages (regular expressions) of warnings torch issues on every single-process DCP read or write:
the tools are single-process by design, so these say nothing to a CLI user and are not shown."""


def _version() -> str:
    """``sparse_ckpt X (torch Y, core Z)`` without importing torch (its version from its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    from .. import _backend

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"sparse_ckpt {__version__} (torch {torch_version}, core {_backend.NAME})"


class _VersionAction(argparse.Action):
    """``--version``: the text is built when asked for (it reads the core choice), not for every parse."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            default=argparse.SUPPRESS,
            help="show the version of sparse_ckpt, torch and the core, and exit",
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(_version())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sparse_ckpt",
        description="Inspect, verify, diff, convert and export sparse_ckpt optimizer state in DCP checkpoints.",
    )
    parser.add_argument("--version", action=_VersionAction)
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
    d.add_argument(
        "--layout",
        action="store_true",
        help="also compare the layout: leaves, groups by index and their parameters (default: what they mean, by FQN)",
    )
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument("--exit-code", action="store_true", help=f"exit {EXIT_DIFFERENT} when they differ")
    c = sub.add_parser("convert", help="rewrite the optimizer part between packed and flat format")
    c.add_argument("src", help="source DCP checkpoint directory")
    c.add_argument("dst", help="destination directory (new or empty)")
    c.add_argument("--to", required=True, choices=("packed", "flat"), help="target format")
    c.add_argument("--key", help=key_help)
    c.add_argument("--leaf", help="leaf name for flat -> packed (default: the name of a single optimizer's leaf)")
    c.add_argument("--drop-empty-groups", action="store_true", help="packed -> flat: drop groups without parameters")
    c.add_argument(
        "--fqns",
        metavar="FILE",
        help="a torch optimizer.state_dict() (int ids): its parameters' FQNs, one per line, in the optimizer's order",
    )
    e = sub.add_parser("export", help="write the optimizer part as safetensors + JSON (no pickle)")
    e.add_argument("checkpoint", help="DCP checkpoint directory")
    e.add_argument("out", help="destination directory (new or empty)")
    e.add_argument("--key", help="the optimizer's key (default: the checkpoint's only optimizer)")
    e.add_argument("--leaf", help="leaf name for flat-format settings (default: the name of a single optimizer's leaf)")
    r = sub.add_parser(
        "run",
        add_help=False,
        help="run a command with sparse_ckpt active in every Python process it starts (sparse-ckpt-run)",
    )
    r.add_argument("args", nargs=argparse.REMAINDER, help="sparse-ckpt-run's options and the command")
    return parser


def _run(args: argparse.Namespace, out: Callable[[str], None], err: Callable[[str], None]) -> int:
    leaf = {} if getattr(args, "leaf", None) is None else {"leaf": args.leaf}
    if args.command == "inspect":
        from .inspect import format_inspect, inspect_details

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
        from .verify import format_verify, verify_checkpoint

        report = verify_checkpoint(args.checkpoint)
        out(json.dumps(report, indent=2) if args.json else format_verify(report))
        return EXIT_OK if report["ok"] else EXIT_ERROR
    if args.command == "diff":
        from .diff import diff_checkpoints, format_diff
        from .inspect import jsonable

        report = diff_checkpoints(args.a, args.b, args.key, layout=args.layout)
        out(json.dumps(jsonable(report), indent=2) if args.json else format_diff(report))
        return EXIT_DIFFERENT if args.exit_code and report["differences"] else EXIT_OK
    if args.command == "convert":
        from .convert import convert_checkpoint

        keys = convert_checkpoint(
            args.src,
            args.dst,
            args.to,
            key=args.key,
            drop_empty_groups=args.drop_empty_groups,
            fqns=_read_fqns(args.fqns),
            **leaf,
        )
        shown = ", ".join(repr(k or "(top level)") for k in keys)
        out(f"wrote {args.dst}: optimizer {shown} in {args.to} format")
        return EXIT_OK
    from .export import export_checkpoint  # safetensors is needed only here

    s = export_checkpoint(args.checkpoint, args.out, args.key, **leaf)
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
        (usage_error,) = _errors("UsageError")
        raise usage_error(f"--fqns: cannot read {path!r}: {exc.strerror}") from None


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
        with warnings.catch_warnings():
            for message in QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
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
    except _errors("NotACheckpointError", "UsageError") as exc:
        err(f"error: {exc}")
        return EXIT_USAGE
    except (*_errors("SparseCheckpointError"), OSError, ImportError) as exc:
        err(f"error: {_first_line(exc)}")
        return EXIT_ERROR
    except _checkpoint_exception() as exc:  # a BaseException: DCP failed outside sparse_ckpt's readers
        failures = getattr(exc, "failures", {}) or {}
        inner = next(iter(failures.values()))[0] if failures else exc
        err(f"error: cannot read checkpoint: {type(inner).__name__}: {_first_line(inner)}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        err("interrupted")
        return 130


def _errors(*names: str) -> tuple[type[BaseException], ...]:
    """The classes ``names`` of `sparse_ckpt.errors` (imported when an exception is being matched)."""
    from .. import errors

    return tuple(getattr(errors, n) for n in names)


def _checkpoint_exception() -> tuple[type[BaseException], ...]:
    """DCP's ``CheckpointException`` once torch was imported (nothing raises it before)."""
    if "torch.distributed.checkpoint" not in sys.modules:
        return ()
    from torch.distributed.checkpoint import CheckpointException

    return (CheckpointException,)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
