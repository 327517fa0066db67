"""sparse_ckpt's benchmarks: ``python -m bench --help`` in a checkout; installed from the wheel as
``sparse_ckpt.bench`` (``python -m sparse_ckpt.bench``, ``sparse-ckpt-bench``). Modules import each
other relatively, so both package names work.

The parts (bench/README.md, "Layout"):

* ``run.py`` and ``suite/``: the bench suite (``python -m bench``): fixtures, methods, timing, reports;
* ``scale/``: the state layouts at scale (``python -m bench.scale``);
* ``trainers/``: a stock trainer's checkpoint against sparse_ckpt's, same model;
* ``drills/``: the resume drill and the reliability sweeps (damaged files, interrupted loads, lost items);
* ``studies/``: one question each (the hot path, a save's phases, the scatter plan, the layout index,
  the export's memory, the flat format, the launcher's start-up);
* ``results_page.py``, ``provenance.py``, ``refresh_results.sh``, ``device_check.sh``: the results page,
  what each result records, the script that re-measures them, the GPU/NPU check.

Every command keeps its short name: ``python -m bench.NAME`` runs ``bench.GROUP.NAME`` for each
``NAME: GROUP`` of `COMMANDS` (older commands, recorded ones included, keep working). Code imports
the full path (``bench.studies.hot_path``); importing the short name says so.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

COMMANDS = {
    "hot_path": "studies",
    "save_phases": "studies",
    "plan_scatter": "studies",
    "layout_index": "studies",
    "export_memory": "studies",
    "flat_format": "studies",
    "launcher_start": "studies",
    "dsd_trainer": "trainers",
    "accelerate_ckpt": "trainers",
    "veomni_checkpointer": "trainers",
    "titan_compare": "trainers",
    "tune_compare": "trainers",
    "resume": "drills",
    "damaged_files": "drills",
    "interrupted_loads": "drills",
    "lost_items": "drills",
}
"""The commands run by their short name, ``python -m bench.NAME``, and the sub-package each lives in."""


def command_module(name: str) -> str:
    """The full module name of the command ``python -m <this package>.NAME`` runs."""
    return f"{__name__}.{COMMANDS[name]}.{name}"


class _ShortNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``python -m bench.NAME`` for a command of `COMMANDS`: runs its module as ``__main__``."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in COMMANDS:
            return None
        real = importlib.util.find_spec(command_module(name))
        return importlib.util.spec_from_loader(fullname, self, origin=None if real is None else real.origin)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        name = spec.name.rpartition(".")[2]
        raise ImportError(
            f"{spec.name} is a command name: import {command_module(name)} (python -m {spec.name} runs it)",
            name=spec.name,
        )

    def exec_module(self, module: ModuleType) -> None:  # pragma: no cover - create_module refuses first
        raise ImportError(module.__name__)

    def get_code(self, fullname: str) -> CodeType:
        """What runpy runs for ``python -m bench.NAME``: the command's module, as ``__main__``."""
        real = command_module(fullname.rpartition(".")[2])
        source = f"import runpy\nrunpy.run_module({real!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<{fullname}: {real}>", "exec")


if not any(isinstance(f, _ShortNames) and getattr(f, "package", None) == __name__ for f in sys.meta_path):
    _finder = _ShortNames()
    _finder.package = __name__  # type: ignore[attr-defined]
    sys.meta_path.append(_finder)
