"""Starting commands as a user would, with and without ``sparse-ckpt-run`` in front.

:func:`child_env` is the environment of every process these tests start: this checkout's
``sparse_ckpt`` first on ``PYTHONPATH`` (never another installed copy), the shared test helpers and
the drill scripts importable, one thread per process. :func:`prefix` is the prefix itself, as
``python -m sparse_ckpt run`` (the ``sparse-ckpt-run`` console script runs the same ``main``; the
wheel test runs the console script).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
DRILLS = Path(__file__).resolve().parent / "drills"
BIN = Path(sys.executable).parent
"""Where the launchers' console scripts (``torchrun``, ``accelerate``) of this interpreter live."""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a started command (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSE_CKPT_") or k == "SPARSE_CKPT_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), str(DRILLS)])
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.update(extra or {})
    return env


def prefix(*options: str) -> list[str]:
    """``sparse-ckpt-run [options]`` as a command-line prefix."""
    return [sys.executable, "-m", "sparse_ckpt", "run", *options]


def run(
    command: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``command`` (its output captured, stdout and stderr together in ``.stdout``)."""
    return subprocess.run(
        list(command),
        env=dict(env or child_env()),
        cwd=cwd or ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
