"""The command line of ``sparse-ckpt-run`` (also ``python -m sparse_ckpt run``): options, the
environment it gives the command, ``--check``, and the ``exec`` of the command."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._version import __version__
from ._sitecustomize import _sparse_ckpt_run as hook

__all__ = ["SITE_DIR", "console_main", "environment", "interpreter_options", "main", "plan", "python_of"]

SITE_DIR = str(Path(hook.__file__).resolve().parent)
"""The folder put at the front of ``PYTHONPATH``: ``sitecustomize.py`` and the hook."""
HOME = str(Path(__file__).resolve().parents[2])
"""The folder holding the ``sparse_ckpt`` package (``SPARSE_CKPT_RUN_HOME``)."""
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND = 0, 1, 2, 126, 127
_MARK = "@@sparse-ckpt-run-check@@"

PROBE = f"""
import importlib, importlib.util, json, sys
hook = sys.modules.get("_sparse_ckpt_run")
out = {{"executable": sys.executable, "python": sys.version.split()[0], "hook": getattr(hook, "__file__", None),
       "triggers": {{}}, "outcomes": [], "problems": [], "selected": []}}
if hook is not None and hook.enabled():
    out["selected"], out["problems"] = hook.selection()
    for name in out["selected"]:
        for trigger in hook.INTEGRATIONS[name].triggers:
            try:
                if importlib.util.find_spec(trigger.split(".")[0]) is None:
                    out["triggers"][trigger] = "not installed"
                    continue
                importlib.import_module(trigger)
                out["triggers"][trigger] = "imported"
            except Exception as exc:
                out["triggers"][trigger] = "import failed: " + type(exc).__name__ + ": " + str(exc)
    out["outcomes"] = hook.outcomes()
    torch = sys.modules.get("torch")
    out["torch"] = getattr(torch, "__version__", None)
print("{_MARK}" + json.dumps(out))
"""
"""Run by ``--check`` with the command's interpreter and environment: imports every selected
integration's trigger module that is installed, as a trainer would, and reports what the hook did."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparse-ckpt-run",
        usage=(
            "sparse-ckpt-run [--integrations LIST] [--strict] [--safe-load] [--log {auto,logging}] [--check] "
            "CMD [ARGS ...]"
        ),
        description=(
            "Run CMD with sparse_ckpt active in every Python process it starts (torchrun and Accelerate "
            "workers, multiprocessing spawn children, subprocesses): torch DSD and the trainers' checkpointing "
            "save and restore optimizer state sparsely and exactly. No change to the training code. "
            "Off with SPARSE_CKPT_RUN=0. See docs/launcher.md."
        ),
    )
    names = ", ".join(f"{n}{'' if i.default else ' (opt-in)'}" for n, i in hook.INTEGRATIONS.items())
    p.add_argument(
        "--integrations",
        metavar="LIST",
        help="comma-separated: auto (default: every integration not marked opt-in), none, NAME, -NAME; "
        f"integrations: {names} "
        "(sets SPARSE_CKPT_INTEGRATIONS)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a process whose integration fails to install stops (SPARSE_CKPT_RUN_STRICT=1) "
        "instead of running stock with a warning",
    )
    p.add_argument(
        "--safe-load",
        action="store_true",
        help="read every DCP checkpoint as one from elsewhere: .metadata by a "
        "restricted unpickler, bytes items weights-only, nothing outside the checkpoint (SPARSE_CKPT_SAFE_LOAD=1)",
    )
    p.add_argument(
        "--log",
        choices=("auto", "logging"),
        help="auto (default): the routing line goes to stderr when logging would "
        "not show it; logging: only through the sparse_ckpt.launcher logger (SPARSE_CKPT_RUN_LOG)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="do not run CMD: print what would be routed, from a probe process of "
        "CMD's Python interpreter with CMD's environment (exit 1 if an integration would fail)",
    )
    p.add_argument("--version", action="version", version=f"sparse-ckpt-run (sparse_ckpt {__version__})")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS ...]")
    return p


def environment(
    base: Mapping[str, str],
    *,
    integrations: str | None = None,
    strict: bool = False,
    log: str | None = None,
    safe_load: bool = False,
) -> dict[str, str]:
    """The environment the command runs with: ``base`` with `SITE_DIR` first on ``PYTHONPATH``
    (the rest kept as it was), ``SPARSE_CKPT_RUN_HOME`` and the options' variables."""
    env = dict(base)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = SITE_DIR + (os.pathsep + rest if rest else "")
    env["SPARSE_CKPT_RUN_HOME"] = HOME
    if integrations is not None:
        env["SPARSE_CKPT_INTEGRATIONS"] = integrations
    if strict:
        env["SPARSE_CKPT_RUN_STRICT"] = "1"
    if log is not None:
        env["SPARSE_CKPT_RUN_LOG"] = log
    if safe_load:
        env["SPARSE_CKPT_SAFE_LOAD"] = "1"
    return env


def python_of(command: Sequence[str], path: str | None = None) -> tuple[str | None, str]:
    """``(the Python interpreter that runs command[0], how it was found)``; ``None`` when command[0]
    is not a Python program (its Python children would then be started by other programs)."""
    interpreter, _options, how = _python_of(command, path)
    return interpreter, how


def _python_of(command: Sequence[str], path: str | None) -> tuple[str | None, list[str], str]:
    """`python_of` and the interpreter options of a script's ``#!`` line (``#!/usr/bin/python3 -I``)."""
    exe = shutil.which(command[0], path=path)
    if exe is None:
        return None, [], f"{command[0]!r} not found on PATH"
    if _is_python(exe):
        return exe, [], "the command is a Python interpreter"
    try:
        with open(exe, "rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError as exc:
        return None, [], f"cannot read {exe}: {exc}"
    if not first.startswith("#!"):
        return None, [], f"{exe} is not a script with a #! line (a binary?)"
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env":
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):  # env's own options and NAME=VALUE
            words = words[1:]
        words[:1] = [shutil.which(words[0], path=path) or words[0]] if words else []
    if words and _is_python(words[0]):
        return words[0], words[1:], f"the #! line of {exe}"
    return None, [], f"{exe} is run by {words[0] if words else '?'}, not Python"


def _is_python(exe: str) -> bool:
    return re.fullmatch(r"python[0-9.]*", os.path.basename(exe)) is not None


_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")
"""Interpreter options whose value may be the next argument."""


def interpreter_options(args: Sequence[str]) -> list[str]:
    """The interpreter options at the front of ``args`` (what follows ``python`` on a command line), up
    to the script, ``-c``, ``-m`` or ``-``: ``-I``, ``-E``, ``-S`` and the like decide whether the
    hook loads at all, so ``--check`` probes with them."""
    options: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):
            options.append(arg)
            if arg in _OPTIONS_WITH_VALUE and i + 1 < len(args):
                options.append(args[i + 1])
                i += 1
            i += 1
            continue
        flags = arg[1:]  # combined flags (-IB); -c/-m end the options; -X/-W take the rest or the next argument
        for j, flag in enumerate(flags):
            if flag in "cm":
                if j:
                    options.append("-" + flags[:j])
                return options
            if flag in "XW":
                options.append(arg)
                if j == len(flags) - 1 and i + 1 < len(args):
                    options.append(args[i + 1])
                    i += 1
                break
        else:
            options.append(arg)
        i += 1
    return options


def plan(env: Mapping[str, str]) -> list[str]:
    """The integrations that would be activated, one line each, and the selection's problems."""
    selected, problems = hook.selection(env.get("SPARSE_CKPT_INTEGRATIONS", "auto"), dict(env))
    lines = []
    for name, integration in hook.INTEGRATIONS.items():
        if name in selected:
            when = " or ".join(integration.triggers)
            lines.append(f"  {name:<10} when {when} is imported: {integration.routes} -> {integration.module}")
        else:
            lines.append(f"  {name:<10} not selected")
    return lines + [f"  problem: {p}" for p in problems]


def _check(command: Sequence[str], env: dict[str, str], out: list[str]) -> int:
    shown = " ".join(command)
    out.append(f"sparse-ckpt-run --check: {shown}")
    if shutil.which(command[0], path=env.get("PATH")) is None:
        out.append(f"  command:    {command[0]}: command not found (the run would exit {EXIT_NOT_FOUND})")
        out.append("result: error: the command does not exist; nothing would run, nothing would be routed")
        return EXIT_NOT_FOUND
    interpreter, options, how = _python_of(command, env.get("PATH"))
    if interpreter is None:
        out.append(f"  command:    {how}; probing with this interpreter ({sys.executable}) instead")
        interpreter = sys.executable
    else:
        if how == "the command is a Python interpreter":
            options = interpreter_options(command[1:])
        shown_options = f", options {' '.join(options)}" if options else ""
        out.append(f"  command:    Python program, interpreter {interpreter}{shown_options} ({how})")
    out.append(f"  PYTHONPATH: {env['PYTHONPATH']}")
    for key in ("SPARSE_CKPT_INTEGRATIONS", "SPARSE_CKPT_RUN_STRICT", "SPARSE_CKPT_RUN_LOG", "SPARSE_CKPT_SAFE_LOAD"):
        out.append(f"  {key}={env.get(key, '(unset)')}")
    out.append("integrations (each process activates them when it imports their trigger):")
    out.extend(plan(env))
    try:
        proc = subprocess.run(
            [interpreter, *options, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        out.append(f"probe: could not run {interpreter}: {exc}")
        return EXIT_CHECK_FAILED
    found = [line[len(_MARK) :] for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        out.append(f"probe: {interpreter} exited {proc.returncode} without a report: " + " | ".join(tail))
        return EXIT_CHECK_FAILED
    report = json.loads(found[-1])
    out.append(
        f"probe ({report['executable']}, Python {report['python']}, torch {report.get('torch') or 'not imported'}):"
    )
    if not report["hook"]:
        out.append(
            "  the hook did not load in this interpreter (started with -S, -I or -E? another sitecustomize first?)"
        )
        out.append("result: not routed: this command's Python runs stock (the hook did not load)")
        return EXIT_CHECK_FAILED
    for trigger, what in report["triggers"].items():
        out.append(f"  import {trigger}: {what}")
    for o in report["outcomes"]:
        out.append(f"  {o['integration']:<10} {o['status']}: {o['detail']}")
    for p in report["problems"]:
        out.append(f"  problem: {p}")
    bad = report["problems"] or any(o["status"] in ("refused", "failed") for o in report["outcomes"])
    bad = bad or any(w.startswith("import failed") for w in report["triggers"].values())
    if bad and env.get("SPARSE_CKPT_RUN_STRICT") == "1":
        out.append(
            "result: not routed: under --strict a process that imports these triggers stops with an error (see above)"
        )
    else:
        out.append("result: " + ("not routed: some integrations would run stock (see above)" if bad else "ok"))
    return EXIT_CHECK_FAILED if bad else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options and ``exec`` the command (returns only on ``--check`` or an error)."""
    args = _parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        _parser().error("no command given (usage: sparse-ckpt-run [options] CMD [ARGS ...])")
    if not hook.enabled():  # SPARSE_CKPT_RUN=0: the command as it is
        env = dict(os.environ)
        if args.check:
            print(
                f"sparse-ckpt-run --check: SPARSE_CKPT_RUN={env['SPARSE_CKPT_RUN']}: off; {' '.join(command)} runs "
                "stock"
            )
            return EXIT_OK
    else:
        env = environment(
            os.environ, integrations=args.integrations, strict=args.strict, log=args.log, safe_load=args.safe_load
        )
        _, problems = hook.selection(env.get("SPARSE_CKPT_INTEGRATIONS", "auto"), env)
        if problems:
            for p in problems:
                print(f"sparse-ckpt-run: {p}", file=sys.stderr)
            return EXIT_USAGE
        if args.check:
            out: list[str] = []
            status = _check(command, env, out)
            print("\n".join(out))
            return status
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"sparse-ckpt-run: {command[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as exc:
        print(f"sparse-ckpt-run: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    return EXIT_OK  # pragma: no cover - execvpe does not return


def console_main() -> None:
    """The ``sparse-ckpt-run`` console script."""
    sys.exit(main())
