"""The two cores and their stub agree: ``sparse_ckpt/_C.pyi`` is what ``csrc/gen_stub.py`` generates
from the Python twin, the built ``_C`` has exactly the twin's names, constants and parameter lists
(both directions), and the twin package mirrors ``csrc/`` file for file."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import types
from pathlib import Path

import _backends
import pytest

from sparse_ckpt import _core_py

ROOT = Path(__file__).resolve().parents[2]

core_backend = _backends.run_once
"""Stub and interface checks: once, not per backend."""
_spec = importlib.util.spec_from_file_location("gen_stub", ROOT / "csrc" / "gen_stub.py")
gen_stub = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_stub)


def test_checked_in_stub_is_the_generated_one() -> None:
    assert gen_stub.check() == []


def test_stub_check_fails_on_a_stale_stub(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stub = tmp_path / "_C.pyi"
    stub.write_text(gen_stub.render().replace("def unflatten(", "def unflatten_old("))
    problems = gen_stub.check(stub)
    assert len(problems) == 1 and "is stale" in problems[0] and "-def unflatten_old(" in problems[0]
    assert gen_stub.main(["--check", "--stub", str(stub)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert gen_stub.main(["--stub", str(stub)]) == 0  # regenerates it
    assert gen_stub.check(stub) == [] and gen_stub.main(["--check", "--stub", str(stub)]) == 0


def test_stub_names_every_export_of_the_twin() -> None:
    text = gen_stub.render()
    for name in _core_py.__all__:
        assert f"def {name}(" in text or f"\n{name}: " in text, name


def test_built_core_and_twin_agree() -> None:
    c = _backends.cpp_core()
    assert gen_stub.compare_cores(c) == []
    assert set(gen_stub.cpp_signatures(c)) == set(gen_stub.twin_signatures())


def _fake_cpp() -> types.ModuleType:
    """A module shaped like pybind11's ``_C`` (signature line first in each docstring), built from
    the twin, so that the comparison is tested without a C++ build."""
    fake = types.ModuleType("fake_C")
    for name in _core_py.__all__:
        value = getattr(_core_py, name)
        if callable(value):
            params = ", ".join(f"{p}: object" for p in inspect.signature(value).parameters)
            value = _callable_with_doc(f"{name}({params}) -> object\n\nDoc.")
        setattr(fake, name, value)
    return fake


def _callable_with_doc(doc: str):
    def f(*args, **kwargs):  # only its docstring is read
        return None

    f.__doc__ = doc
    return f


def test_core_comparison_finds_each_difference_both_ways() -> None:
    fake = _fake_cpp()
    assert gen_stub.compare_cores(fake) == []
    del fake.unflatten  # the twin has it, _C not
    fake.extra_kernel = _callable_with_doc("extra_kernel(a: object) -> object")  # _C has it, the twin not
    fake.match_groups = _callable_with_doc("match_groups(leaf: str, fqns: object, settings_of: object) -> tuple")
    fake.VERSION = 2
    problems = gen_stub.compare_cores(fake)
    assert len(problems) == 4, problems
    assert any("_C.extra_kernel has no twin" in p for p in problems)
    assert any("sparse_ckpt._core_py.unflatten is missing from _C" in p for p in problems)
    assert any(p.startswith("match_groups: _C takes (leaf, fqns, settings_of)") for p in problems)
    assert any(p.startswith("constant VERSION") for p in problems)


def test_twin_exports_exactly_its_all() -> None:
    public = {n for n, v in vars(_core_py).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public == set(_core_py.__all__)


def test_twin_mirrors_csrc_file_for_file() -> None:
    """``csrc/X.cpp`` <-> ``sparse_ckpt/_core_py/X.py`` (``bindings.cpp`` is the package's
    ``__init__``); each twin module names its C++ file in its docstring."""
    cpp = {p.stem for p in (ROOT / "csrc").glob("*.cpp")} - {"bindings"}
    twin_dir = ROOT / "sparse_ckpt" / "_core_py"
    twin = {p.stem for p in twin_dir.glob("*.py")} - {"__init__"}
    assert cpp == twin
    for stem in twin:
        doc = importlib.import_module(f"sparse_ckpt._core_py.{stem}").__doc__ or ""
        assert f"csrc/{stem}.cpp" in doc, stem
