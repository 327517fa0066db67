"""A command in a child process, as the CLI, startup and packaging tests run one.

* :data:`REPO` -- the checkout's root (what the children import ``sparse_ckpt`` from).
* :func:`repo_env` -- the environment with :data:`REPO` first on ``PYTHONPATH``.
* :func:`run` -- the command, its output captured as text, never raising on a non-zero status (the
  tests assert on ``returncode``, ``stdout`` and ``stderr`` themselves).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with :data:`REPO` first on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run(
    command: Sequence[str], *, cwd: Path = REPO, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd`` with ``env`` (default: inherited), output captured as text, any exit status."""
    return subprocess.run(list(command), check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
