"""The API reference builds from the docstrings (docs/api.py, pdoc) with no warning but the one kind
it expects, and renders the public surface: the top-level API, the errors, the export, the tools,
the integrations (not their private helpers). No trainer package is needed: where torchtitan is not
installed, its integration's page is left out and the build says so with the install line. Skipped
where pdoc is not installed (it is in the ``test`` extra; .ci/run builds the reference too)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_api_reference_builds_the_public_surface(tmp_path: Path) -> None:
    if importlib.util.find_spec("pdoc") is None:
        pytest.skip("pdoc is not installed (pip install -e '.[test]')")
    # In its own process: pdoc evaluates the annotations of what it renders in place (torchtitan's
    # string annotations on SparseCheckpointManager become types), which later tests compare.
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "api.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr  # no warning but the allowed kind
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    assert {"sparse_ckpt.html", "sparse_ckpt/errors.html", "sparse_ckpt/export.html", "sparse_ckpt/tools.html"} <= pages
    assert not [p for p in pages if "/_" in p], pages  # no private module
    lazy = {f"sparse_ckpt/integrations/{name}.html" for name in ("dsd", "veomni", "accelerate", "torchtune")}
    assert lazy <= pages, pages  # they import their trainers lazily: rendered without them
    titan = "sparse_ckpt/integrations/torchtitan.html"
    if importlib.util.find_spec("torchtitan") is None:
        assert titan not in pages
        assert "sparse_ckpt.integrations.torchtitan left out" in done.stdout, done.stdout
        assert "pip install --no-deps -r .ci/requirements-torchtitan.txt" in done.stdout, done.stdout
    else:
        assert titan in pages and "left out" not in done.stdout, done.stdout
    top = (tmp_path / "sparse_ckpt.html").read_text(encoding="utf-8")
    for name in ("SparseOptimizerState", "SparseLoadPlanner", "MultiOptimizer", "sparse_state_dict"):
        assert f'id="{name}"' in top, name
    assert ":func:`" not in top and ":class:`" not in top  # Sphinx roles render as nothing here
