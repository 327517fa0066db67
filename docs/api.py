"""Build the API reference from the docstrings: ``python docs/api.py OUT_DIR`` (pdoc, pinned in the
``test`` extra; .ci/run runs it). Only the public surface is rendered: the top-level API (``import
sparse_ckpt as sc``), ``sparse_ckpt.errors``, ``sparse_ckpt.export``, ``sparse_ckpt.tools`` and
``sparse_ckpt.integrations`` (its private helper modules, and the modules behind the ``dsd`` package's
names, left out) and ``sparse_ckpt.launcher`` (its hook folder left out), exactly README's API table.

Any warning pdoc issues fails the build (exit status 1, each warning on stderr), but one kind: the
annotations that ``SparseCheckpointManager`` takes over from torchtitan (the signature of
``CheckpointManager.__init__``, and the fields of its ``Config``) name types that torchtitan's own
modules import (some only for type checking, one needing ``torchdata``, which torchtitan does not
install); pdoc cannot evaluate them in sparse_ckpt's module and shows them as written.

No trainer package is needed: the integrations import their trainers lazily, except
``sparse_ckpt.integrations.torchtitan``, whose ``SparseCheckpointManager`` subclasses torchtitan's
manager when the module is imported. Where torchtitan is not installed that one page is left out, and
the build says so on stdout with the line that installs it (`NEEDS`); everything else renders.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES = [
    "sparse_ckpt",
    "sparse_ckpt.errors",
    "sparse_ckpt.export",
    "sparse_ckpt.tools",
    "sparse_ckpt.integrations",
    r"!sparse_ckpt\.integrations\._.*",
    r"!sparse_ckpt\.integrations\.dsd\..*",
    "sparse_ckpt.launcher",
    r"!sparse_ckpt\.launcher\._.*",
]
"""What pdoc renders (``!``: left out)."""

ALLOWED = re.compile(
    r"(Error parsing type annotation|Failed to run TYPE_CHECKING code).*"
    r"sparse_ckpt\.integrations\.torchtitan\.SparseCheckpointManager\.(Config\.)?__init__"
)
"""The one kind of pdoc warning that does not fail the build (see the module docstring)."""

NEEDS = {
    "sparse_ckpt.integrations.torchtitan": ("torchtitan", "pip install --no-deps -r .ci/requirements-torchtitan.txt"),
}
"""The integration modules that import their trainer when imported: module -> (trainer's import
name, the line that installs it). Left out of the reference where the trainer is not installed."""


def left_out() -> dict[str, str]:
    """The modules of `NEEDS` whose trainer is not installed here: module -> the line that installs it."""
    return {module: line for module, (trainer, line) in NEEDS.items() if importlib.util.find_spec(trainer) is None}


def build(out_dir: Path) -> list[str]:
    """Render the reference into ``out_dir``; returns the warnings that fail the build."""
    import pdoc
    import pdoc.render

    sys.path.insert(0, str(ROOT))
    missing = left_out()
    modules = MODULES + ["!" + re.escape(module) for module in missing]
    # pdoc still tries such a module when it lists its package's submodules, and says it could not
    unimportable = [re.compile(f"^Couldn't import {re.escape(module)}:") for module in missing]
    pdoc.render.configure(docformat="restructuredtext", show_source=False, search=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=out_dir)
    texts = [str(w.message) for w in caught if w.category is not DeprecationWarning]
    return [t for t in texts if not ALLOWED.search(t) and not any(u.search(t) for u in unimportable)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python docs/api.py OUT_DIR", file=sys.stderr)
        return 2
    for module, line in left_out().items():
        print(f"docs/api.py: {module} left out of the reference: its trainer is not installed; {line}")
    problems = build(Path(argv[0]))
    for text in problems:
        print(f"docs/api.py: pdoc: {text}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
