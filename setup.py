"""Build the C++ core ``sparse_ckpt._C`` (CMake + Ninja + pybind11); the package's metadata is in
pyproject.toml.

``pip install .`` / ``pip wheel .`` pull pybind11, cmake and ninja into the isolated build
environment (see pyproject.toml). For development: ``pip install -e .`` or
``python setup.py build_ext --inplace`` (puts ``_C*.so`` into ``sparse_ckpt/``).
Extra CMake arguments come from ``CMAKE_ARGS`` (the convention of scikit-build and pybind's
cmake_example), e.g. ``CMAKE_ARGS="-DCMAKE_CXX_COMPILER=clang++"``. A build tree configured from
another source directory (a copied checkout with its ``build/``) is detected and configured anew.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension built by CMakeLists.txt rather than by setuptools."""

    def __init__(self, name: str, sourcedir: Path = ROOT) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = os.fspath(sourcedir)


def _tool(module: str, attr: str, exe: str) -> str:
    """Path of ``exe`` from its PyPI package (``cmake``/``ninja``), else from PATH."""
    try:
        bin_dir = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        bin_dir = None
    if bin_dir is not None and (Path(bin_dir) / exe).exists():
        return os.fspath(Path(bin_dir) / exe)
    found = shutil.which(exe)
    if found is None:
        raise RuntimeError(f"{exe} not found: `pip install {module}` or put {exe} on PATH")
    return found


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        import pybind11

        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        ext_dir = ext_path.parent
        ext_dir.mkdir(parents=True, exist_ok=True)
        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        args = [
            "-G",
            "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DCMAKE_BUILD_TYPE={'Debug' if self.debug else 'Release'}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DSPARSE_CKPT_OUTPUT_DIR={ext_dir}",
            "-DSPARSE_CKPT_SANITIZE=OFF",  # explicit, so a cached ON never outlives its request
        ]
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        build_temp = Path(self.build_temp).resolve() / "cmake"
        _drop_foreign_cache(build_temp, Path(ext.sourcedir))
        build_temp.mkdir(parents=True, exist_ok=True)
        subprocess.run([cmake, "-S", ext.sourcedir, "-B", os.fspath(build_temp), *args], check=True)
        parallel = ["--parallel", str(self.parallel)] if self.parallel else []
        subprocess.run([cmake, "--build", os.fspath(build_temp), *parallel], check=True)
        if not ext_path.exists():
            raise RuntimeError(f"CMake did not produce {ext_path}")


def _drop_foreign_cache(build_temp: Path, sourcedir: Path) -> None:
    """Remove ``build_temp`` when its CMake cache belongs to another source directory (a checkout
    copied with its ``build/``): CMake refuses to reuse it ("does not match the source ... used to
    generate cache")."""
    cache = build_temp / "CMakeCache.txt"
    if not cache.is_file():
        return
    found = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", cache.read_text(errors="replace"), re.MULTILINE)
    if found is None or Path(found.group(1)).resolve() != sourcedir.resolve():
        print(f"sparse_ckpt: {build_temp} was configured for another source directory; configuring anew")
        shutil.rmtree(build_temp)


setup(
    ext_modules=[CMakeExtension("sparse_ckpt._C")],
    cmdclass={"build_ext": CMakeBuild},
)
