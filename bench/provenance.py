"""Where and when a bench result was measured, and with which package: the ``provenance`` entry
every bench writes into its JSON (`record`), and the rule that says whether a result is still
current (`problems`, which ``python -m bench.results_page --check`` applies).

A result is current when it records the commit, date, machine and load it was measured at, and
its ``inputs`` equal `current_inputs()`: the bench inputs version `BENCH_INPUTS_VERSION`, the
package's default state layout and the version of every checkpoint format it writes. A change to
the default layout or to a format's version makes every older result stale by itself; a change
that alters what the benches measure without either (a new ``auto`` threshold, another fixture)
bumps `BENCH_INPUTS_VERSION`.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_INPUTS_VERSION = 1
"""Bumped by hand when a change alters what the benches measure without changing the package's
default state layout or a format version (those are compared on their own): every committed
result then needs a re-measure (``bash bench/refresh_results.sh``)."""

FIELDS = ("commit", "date", "machine", "load_average", "inputs")
"""What a result's ``provenance`` entry holds."""

_LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None
"""The load average when the bench process started (this module is imported before anything is measured)."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# What the benches and the results page write into the checkout: not a change of what is measured.
OUTPUTS = ("bench/results", "docs/results.md", "docs/img")
EXCLUDED_OUTPUTS = tuple(f":(exclude){path}" for path in OUTPUTS)


def commit(root: Path | None = None) -> str:
    """The commit of the checkout at ``root`` (default: the one this bench is in), ``-dirty`` when its
    tracked files have changes other than the measurements themselves (``OUTPUTS``: a refresh rewrites
    them one after another), or the installed package's version outside a checkout."""
    root = Path(__file__).resolve().parents[1] if root is None else root

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        if (root / ".git").exists() and (root / "sparse_ckpt").is_dir():
            sha = git("rev-parse", "--short=12", "HEAD")
            changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *EXCLUDED_OUTPUTS)
            return sha + ("-dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        pass
    import sparse_ckpt

    return f"sparse_ckpt {sparse_ckpt.__version__} (installed)"


def current_inputs() -> dict[str, Any]:
    """What makes a result current: `BENCH_INPUTS_VERSION`, the default state layout and the format versions."""
    from sparse_ckpt._core_py.common import VERSION as CORE_VERSION
    from sparse_ckpt._core_py.layout_codec import LAYOUT_VERSION
    from sparse_ckpt._core_py.table_codec import NAMED_VERSION
    from sparse_ckpt._format.bucket_checksums import CHECKSUMS_VERSION
    from sparse_ckpt._format.layout_index import INDEX_VERSION
    from sparse_ckpt._layouts import DEFAULT_STATE_LAYOUT
    from sparse_ckpt.tools._export_format import EXPORT_VERSION

    return {
        "bench_inputs_version": BENCH_INPUTS_VERSION,
        "default_state_layout": DEFAULT_STATE_LAYOUT,
        "formats": {
            "core": CORE_VERSION,
            "named_table": NAMED_VERSION,
            "layout_table": LAYOUT_VERSION,
            "layout_index": INDEX_VERSION,
            "bucket_checksums": CHECKSUMS_VERSION,
            "export": EXPORT_VERSION,
        },
    }


def record() -> dict[str, Any]:
    """The ``provenance`` entry of a result written now: commit, UTC date, machine, load average
    when the process started and now, and `current_inputs`."""
    import torch

    after = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "load_average": {
            "before": None if _LOAD_AT_START is None else list(_LOAD_AT_START),
            "after": None if after is None else list(after),
        },
        "inputs": current_inputs(),
    }


def problems(name: str, data: dict[str, Any], rerun: str) -> list[str]:
    """Why the result ``data`` (the JSON file ``name``) is not current, each naming the file and ``rerun``;
    [] if it is."""
    prov = data.get("provenance") if isinstance(data, dict) else None
    if not isinstance(prov, dict):
        return [f"{name}: records no provenance (commit, date, machine, load); rerun: {rerun}"]
    missing = [k for k in FIELDS if k not in prov]
    if missing:
        return [f"{name}: its provenance lacks {', '.join(missing)}; rerun: {rerun}"]
    now = current_inputs()
    changed = [f"{k} {prov['inputs'].get(k)!r} (now {v!r})" for k, v in now.items() if prov["inputs"].get(k) != v]
    if changed:
        return [
            f"{name}: measured at {prov['commit']} ({prov['date']}) with {'; '.join(changed)}: stale; rerun: {rerun}"
        ]
    return []


if __name__ == "__main__":  # pragma: no cover - a quick look at what a result would record
    import json

    json.dump(record(), sys.stdout, indent=1)
    print()
