"""bench/ in parts: the suite, scale, trainers, drills and studies sub-packages, each listed in
bench/README.md's Layout table and shipped in the wheel; every ``python -m bench...`` command the
docs, the changelog and the CI scripts show resolves (the commands keep their short names, which
run the moved modules), and importing a short name names the full path."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys

import _backends
import pytest
import tomllib
from doc_blocks import ROOT

import bench

core_backend = _backends.run_once
"""Nothing here depends on the core backend: once is enough."""

BENCH = ROOT / "bench"
TOP_LEVEL = {"__init__.py", "__main__.py", "run.py", "results_page.py", "provenance.py"}
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "CHANGELOG.md",
    BENCH / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / ".ci").iterdir()),
    *sorted(BENCH.glob("*.sh")),
]
MODULE_COMMAND = re.compile(r"python3? -m (?:sparse_ckpt\.)?(bench(?:\.\w+)*)")
SCRIPT_COMMAND = re.compile(r"python3? (bench/[\w/]+\.py)")


def _subpackages() -> list[str]:
    return sorted(p.parent.name for p in BENCH.glob("*/__init__.py"))


def test_the_top_level_holds_only_the_entry_points() -> None:
    assert {p.name for p in BENCH.glob("*.py")} == TOP_LEVEL
    assert set(_subpackages()) == {"suite", "scale", "trainers", "drills", "studies"}


def test_the_readme_maps_every_part_and_the_wheel_ships_it() -> None:
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    for name in _subpackages():
        assert f"[`{name}/`]({name}/)" in layout, name
    for name in TOP_LEVEL - {"__init__.py"}:
        assert f"`{name}`" in layout, name
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]
    assert {f"sparse_ckpt.bench.{name}" for name in _subpackages()} <= set(packages)


def test_every_command_short_name_runs_its_module() -> None:
    for name, group in bench.COMMANDS.items():
        assert (BENCH / group / f"{name}.py").is_file(), name
        assert importlib.util.find_spec(f"bench.{name}") is not None, name
        assert not (BENCH / f"{name}.py").exists(), f"bench/{name}.py would shadow the command name"


def test_every_documented_command_resolves() -> None:
    seen = set()
    for path in DOCUMENTS:
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        for module in MODULE_COMMAND.findall(text):
            if module != module.lower():  # a placeholder: python -m bench.NAME
                continue
            seen.add(module)
            assert importlib.util.find_spec(module) is not None, f"{where}: python -m {module}"
        for script in SCRIPT_COMMAND.findall(text):
            assert (ROOT / script).is_file(), f"{where}: python {script}"
    assert {"bench", "bench.scale", "bench.hot_path", "bench.resume"} <= seen


def test_a_short_name_runs_and_its_import_names_the_full_path() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.hot_path", "--help"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "--rounds" in done.stdout, done.stderr
    with pytest.raises(ImportError, match=r"import bench\.studies\.hot_path \(python -m bench\.hot_path runs it\)"):
        importlib.import_module("bench.hot_path")
