"""Package metadata and the public API.

* One version: ``sparse_ckpt/_version.py`` is the only place it is written; ``pyproject.toml`` reads it
  without importing the package (the isolated build environment has no torch) and the installed
  distribution's metadata carries the same version as ``sparse_ckpt.__version__``.
* The license: ``LICENSE`` is the Apache License 2.0 and pyproject.toml declares it.
* The public API: every ``__all__`` name resolves, the re-exports are the modules' own objects,
  the module docstring lists them, and ``import sparse_ckpt`` does not import ``safetensors``.

The subprocess probes are backend independent; they run once per session (``functools.cache``),
so the second conftest backend parameter costs nothing.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import child_process
import pytest

import sparse_ckpt
from sparse_ckpt import errors, export, tools
from sparse_ckpt._dcp import metadata as checkpoint_io
from sparse_ckpt.integrations import veomni as sc_veomni

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(sparse_ckpt.__file__).resolve().parent

# Reads pyproject.toml's [project] table as setuptools expands it (the version from
# sparse_ckpt/_version.py), with torch and sparse_ckpt unimportable, warnings as errors; and the
# keywords of setup.py's setup() call (nothing is built), which must be the build only.
SETUP_PROBE = """
import json, runpy, sys, warnings
sys.modules["torch"] = None
sys.modules["sparse_ckpt"] = None
import setuptools
from setuptools.config.pyprojecttoml import read_configuration
with warnings.catch_warnings():
    warnings.simplefilter("error")
    config = read_configuration("pyproject.toml", expand=True)
project = config["project"]
kwargs = {}
setuptools.setup = lambda **kw: kwargs.update(kw)
runpy.run_path("setup.py", run_name="__main__")
print(json.dumps({
    "version": project["version"],
    "license": None,
    "license_expression": project.get("license"),
    "classifiers": project["classifiers"],
    "project_urls": project.get("urls", {}),
    "extras": sorted(project["optional-dependencies"]),
    "packages": config["tool"]["setuptools"]["packages"],
    "setup_keywords": sorted(kwargs),
}))
"""

IMPORT_PROBE = """
import json, sys
import sparse_ckpt
print(json.dumps({"safetensors": "safetensors" in sys.modules}))
"""


def _probe(code: str) -> dict:
    proc = child_process.run([sys.executable, "-c", code], cwd=ROOT, env=child_process.repo_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def setup_metadata() -> dict:
    return _probe(SETUP_PROBE)


@functools.cache
def fresh_import() -> dict:
    return _probe(IMPORT_PROBE)


# ----------------------------------------------------------------------------- version


def test_version_is_written_once() -> None:
    text = (PACKAGE / "_version.py").read_text(encoding="utf-8")
    assert re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE).group(1) == sparse_ckpt.__version__
    for path in (ROOT / "setup.py", PACKAGE / "__init__.py"):
        assert sparse_ckpt.__version__ not in path.read_text(encoding="utf-8"), f"{path.name} repeats the version"


def test_setup_reads_the_version_without_torch() -> None:
    assert setup_metadata()["version"] == sparse_ckpt.__version__


def _describes_imported_package(dist: importlib.metadata.Distribution) -> bool:
    """Whether ``dist`` is the distribution of the ``sparse_ckpt`` imported here.

    A regular install (and the in-tree ``sparse_ckpt.egg-info`` that ``pip install -e .`` or
    ``setup.py egg_info`` writes) lists the package's files next to its metadata; a PEP 660
    editable install keeps its metadata in site-packages and names the project directory in
    ``direct_url.json``. Any other ``sparse_ckpt`` on the path (another checkout) is not ours.
    """
    init = Path(dist.locate_file("sparse_ckpt/__init__.py"))
    if init.exists() and init.resolve() == PACKAGE / "__init__.py":
        return True
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    if not direct_url.get("dir_info", {}).get("editable"):
        return False
    url = urlparse(direct_url.get("url", ""))
    return url.scheme == "file" and Path(url2pathname(unquote(url.path))).resolve() == PACKAGE.parent


def test_version_matches_installed_distribution() -> None:
    """Every installed metadata that describes this checkout has ``sparse_ckpt.__version__``.

    An editable install's metadata is written at install time: after a version bump it is stale
    until ``pip install -e .`` runs again, and this test says so.
    """
    found = list(importlib.metadata.distributions(name="sparse_ckpt"))
    if not found:
        pytest.skip("sparse_ckpt is not installed (e.g. built with setup.py build_ext --inplace)")
    ours = [d for d in found if _describes_imported_package(d)]
    if not ours:
        where = [str(d.locate_file("")) for d in found]
        pytest.skip(f"no installed sparse_ckpt metadata describes {PACKAGE.parent} (found at {where})")
    for dist in ours:
        assert dist.version == sparse_ckpt.__version__, (
            f"installed metadata at {dist.locate_file('')} says {dist.version}, the package says "
            f"{sparse_ckpt.__version__}: reinstall (pip install -e .)"
        )


# ----------------------------------------------------------------------------- license


def test_license_file_and_metadata() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("Copyright 2026 The sparse_ckpt authors\n")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and text.rstrip().endswith("limitations under the License.")
    md = setup_metadata()
    if md["license_expression"] is not None:  # setuptools >= 77 (PEP 639)
        assert md["license_expression"] == "Apache-2.0"
        assert not [c for c in md["classifiers"] if c.startswith("License ::")]
    else:
        assert md["license"] == "Apache-2.0"
        assert "License :: OSI Approved :: Apache Software License" in md["classifiers"]
    # The project has no public home: no URLs rather than placeholders.
    assert not [u for u in md["project_urls"].values() if "example." in u], md["project_urls"]


def test_setup_py_only_builds_the_extension() -> None:
    """The metadata is pyproject.toml's (PEP 621); setup.py passes only the CMake build."""
    assert setup_metadata()["setup_keywords"] == ["cmdclass", "ext_modules"]


def test_pyproject_lists_every_package() -> None:
    """pyproject.toml lists the packages explicitly (the bench is mapped from bench/): every package
    folder of sparse_ckpt/ and of bench/ must be there, or the wheel would miss it."""
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    bench = {
        ".".join(("sparse_ckpt", *p.parent.relative_to(ROOT).parts)) for p in (ROOT / "bench").rglob("__init__.py")
    }
    assert set(setup_metadata()["packages"]) == folders | bench


def test_readme_install_commands_name_existing_extras() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = re.findall(r'"(?:sparse_ckpt|\.)\[([\w,]+)\]"', readme)  # "sparse_ckpt[bench]", -e ".[test]"
    extras = {e for group in named for e in group.split(",")}
    assert extras and extras <= set(setup_metadata()["extras"]), extras


# ----------------------------------------------------------------------------- public API


def test_public_names_resolve_and_are_documented() -> None:
    doc = sparse_ckpt.__doc__ or ""
    for name in sparse_ckpt.__all__:
        assert hasattr(sparse_ckpt, name), name
        assert re.search(rf"\b{re.escape(name)}\b", doc), f"{name} is not in the module docstring"


def test_tools_and_export_are_submodules() -> None:
    """The checkpoint tools and the export live in their submodules, not at the top level."""
    assert tools.__all__ == ["convert_checkpoint", "diff_checkpoints", "inspect_checkpoint", "verify_checkpoint"]
    for name in tools.__all__:
        assert getattr(tools, name).__module__ == f"sparse_ckpt.tools.{name.split('_')[0].removesuffix('s')}"
    for name in ("export_checkpoint", "load_export", "read_export"):
        assert name in export.__all__
    assert "UsageError" in errors.__all__
    for name in (*tools.__all__, "export_checkpoint", "load_export", "read_export", "UsageError"):
        assert not hasattr(sparse_ckpt, name) and name not in sparse_ckpt.__all__


# The top-level API the docs present: save/load, DCP, MultiOptimizer, adapters, the errors
# a user catches, and the helpers. Tools, export and integrations are submodules.
TOP_LEVEL_API = {
    "sparse_state_dict",
    "load_sparse_state_dict",
    "SparseOptimizerState",
    "SparseLoadPlanner",
    "MultiOptimizer",
    "SafeFileSystemReader",
    "register_state_dict_adapter",
    "AdapterHandle",
    "SparseCheckpointError",
    "UnsupportedStateDictError",
    "ReentrantSerializationError",
    "CheckpointMismatchError",
    "CrossRankStateError",
    "CheckpointFormatError",
    "clear_fqn_cache",
    "backend",
    "__version__",
}


def test_top_level_exports_exactly_the_public_api() -> None:
    assert len(sparse_ckpt.__all__) == len(set(sparse_ckpt.__all__)), "a name is listed twice in __all__"
    assert set(sparse_ckpt.__all__) == TOP_LEVEL_API
    # nothing public at top level beyond __all__ but the package's own submodules (and the __future__ import)
    public = {
        n
        for n, v in vars(sparse_ckpt).items()
        if not n.startswith("_") and not isinstance(v, type(sys)) and v is not __future__.annotations
    }
    assert public <= set(sparse_ckpt.__all__), public - set(sparse_ckpt.__all__)


def test_top_level_errors_are_those_of_the_errors_module() -> None:
    for name in sparse_ckpt.__all__:
        value = getattr(sparse_ckpt, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert value is getattr(errors, name) and name in errors.__all__, name
    assert set(errors.__all__) == {
        n for n, v in vars(errors).items() if isinstance(v, type) and v.__module__ == errors.__name__
    }


def _exception_classes(path: Path) -> set[str]:
    """Names of the classes ``path`` defines that derive from an exception or warning class: a builtin
    one, one of ``sparse_ckpt.errors``, or one named ``*Error``/``*Exception``/``*Warning``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            builtin = getattr(builtins, name, None)
            if (
                name.endswith(("Error", "Exception", "Warning"))
                or hasattr(errors, name)
                or (isinstance(builtin, type) and issubclass(builtin, BaseException))
            ):
                found.add(node.name)
    return found


def test_every_exception_and_warning_class_is_in_the_errors_module() -> None:
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel != "errors.py" and (names := _exception_classes(path)):
            outside[rel] = names
    assert _exception_classes(PACKAGE / "errors.py") == set(errors.__all__)
    assert outside == {}, f"define exception and warning classes in sparse_ckpt/errors.py: {outside}"


def test_modules_reexport_the_errors_their_users_import() -> None:
    """Import paths users have keep working after the classes moved to ``sparse_ckpt.errors``."""
    assert sc_veomni.StockCheckpointWarning is errors.StockCheckpointWarning
    assert "StockCheckpointWarning" in sc_veomni.__all__
    assert issubclass(errors.StockCheckpointWarning, UserWarning)
    assert checkpoint_io.NotACheckpointError is errors.NotACheckpointError
    assert issubclass(errors.NotACheckpointError, errors.CheckpointFormatError)


def test_import_does_not_load_safetensors() -> None:
    assert fresh_import() == {"safetensors": False}


def _copy_source_tree(dst: Path) -> None:
    """The files a build reads, without build outputs (``*.so``, caches, bench outputs)."""
    import shutil

    dst.mkdir()
    for name in ("setup.py", "CMakeLists.txt", "README.md", "pyproject.toml", "LICENSE", "MANIFEST.in"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    for folder in ("csrc", "sparse_ckpt", "bench"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("*.so", "__pycache__", "out*"))


def _setup(cwd: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@functools.cache
def _sdist_and_its_build_py(tmp: str) -> tuple[set[str], Path]:
    """The files of an sdist built from a copy of the source tree, and the ``build_lib`` folder that
    ``setup.py build_py`` (what a wheel's pure part is, nothing compiled) makes from that sdist."""
    import tarfile

    tmp_path = Path(tmp)
    _copy_source_tree(tmp_path / "src")
    _setup(tmp_path / "src", "sdist", "-d", str(tmp_path / "dist"))
    (sdist,) = (tmp_path / "dist").glob("sparse_ckpt-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    _setup(unpacked, "build_py", "--build-lib", str(tmp_path / "lib"))
    return names, tmp_path / "lib"


def test_sdist_builds_the_core_and_ships_py_typed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The sdist holds ``py.typed``, ``_C.pyi`` and every C++ source CMakeLists.txt compiles, and the
    package a wheel built from that sdist installs has ``py.typed`` (PEP 561) and ``_C.pyi``."""
    names, lib = _sdist_and_its_build_py(str(tmp_path_factory.mktemp("sdist")))
    cmake_sources = set(re.findall(r"\bcsrc/\w+\.cpp\b", (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")))
    assert cmake_sources, "CMakeLists.txt names no csrc/*.cpp"
    missing = {"CMakeLists.txt", "sparse_ckpt/py.typed", "sparse_ckpt/_C.pyi", "csrc/core.hpp"} | cmake_sources
    assert missing <= names, sorted(missing - names)
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
    assert (lib / "sparse_ckpt" / "py.typed").is_file()
    assert (lib / "sparse_ckpt" / "_C.pyi").is_file()


@functools.cache
def _configure_copied_checkout(tmp: str) -> subprocess.CompletedProcess[str]:
    """``setup.py build_ext`` in a copy of the source tree whose build tree was configured from another
    source directory, with a compiler from ``CMAKE_ARGS`` that does not exist (configure stops there,
    nothing is compiled)."""
    dst = Path(tmp) / "copy"
    _copy_source_tree(dst)
    cache_dir = dst / "build" / "temp" / "cmake"
    cache_dir.mkdir(parents=True)
    (cache_dir / "CMakeCache.txt").write_text(
        "CMAKE_HOME_DIRECTORY:INTERNAL=/another/checkout\nCMAKE_CACHEFILE_DIR:INTERNAL=/another/checkout/build\n"
    )
    env = {**os.environ, "CMAKE_ARGS": "-DCMAKE_CXX_COMPILER=/nonexistent/sparse-ckpt-cxx"}
    return child_process.run(
        [sys.executable, "setup.py", "build_ext", "--build-temp", "build/temp"], cwd=dst, env=env, timeout=300
    )


def test_build_honours_cmake_args_and_replaces_a_foreign_build_tree(tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _configure_copied_checkout(str(tmp_path_factory.mktemp("setup")))
    out = run.stdout + run.stderr
    assert "configured for another source directory; configuring anew" in out
    assert "does not match the source" not in out  # CMake's refusal of the foreign cache
    assert "/nonexistent/sparse-ckpt-cxx" in out  # CMAKE_ARGS reached CMake (configure stops at the compiler)
    assert run.returncode != 0
