"""Build sparse_ckpt and its C++ core ``sparse_ckpt._C`` (CMake + Ninja + pybind11).

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

import setuptools
from setuptools import Extension, find_packages, setup
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
        build_type = "Debug" if self.debug else "Release"
        cmake = _tool("cmake", "CMAKE_BIN_DIR", "cmake")
        ninja = _tool("ninja", "BIN_DIR", "ninja")
        args = [
            "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
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
        build = [cmake, "--build", os.fspath(build_temp)]
        if self.parallel:
            build += ["--parallel", str(self.parallel)]
        subprocess.run(build, check=True)
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


def _long_description() -> str:
    readme = ROOT / "README.md"
    return readme.read_text(encoding="utf-8") if readme.exists() else ""


def _version() -> str:
    """``__version__`` of ``sparse_ckpt/_version.py``, read as text: importing the package would
    import torch, which the isolated build environment does not have."""
    text = (ROOT / "sparse_ckpt" / "_version.py").read_text(encoding="utf-8")
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if found is None:
        raise RuntimeError('sparse_ckpt/_version.py has no line __version__ = "X.Y.Z"')
    return found.group(1)


LICENSE = "Apache-2.0"  # SPDX identifier of the LICENSE file (shipped by setuptools' default license_files)
# PEP 639's License-Expression needs setuptools >= 77, which refuses license classifiers next to
# it; older setuptools (pyproject.toml allows >= 64) get the License field and the OSI classifier.
PEP_639 = int(setuptools.__version__.split(".")[0]) >= 77
LICENSE_METADATA = {"license_expression": LICENSE} if PEP_639 else {"license": LICENSE}
LICENSE_CLASSIFIERS = [] if PEP_639 else ["License :: OSI Approved :: Apache Software License"]


# The benchmark lives in the top-level ``bench/`` folder (``python -m bench`` in a checkout) and
# ships inside the wheel as ``sparse_ckpt.bench`` (``python -m sparse_ckpt.bench``,
# ``sparse-ckpt-bench``); its modules import each other relatively, so both names work.
# ``bench/results/`` (the committed run) and ``bench/out/`` are data, not shipped.
BENCH_PACKAGE = "sparse_ckpt.bench"

setup(
    name="sparse_ckpt",
    version=_version(),
    description="Exact, sparse optimizer checkpoints for torch.distributed.checkpoint",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    **LICENSE_METADATA,
    # Placeholders: the project has no public home yet; replace example.com with the real one.
    project_urls={
        "Homepage": "https://example.com/sparse_ckpt",
        "Source": "https://example.com/sparse_ckpt/source",
        "Issues": "https://example.com/sparse_ckpt/issues",
    },
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        *LICENSE_CLASSIFIERS,
    ],
    packages=[*find_packages(exclude=["tests", "tests.*", "bench", "bench.*"]), BENCH_PACKAGE],
    package_dir={BENCH_PACKAGE: "bench"},
    package_data={"sparse_ckpt": ["_C.pyi", "py.typed"], BENCH_PACKAGE: ["README.md"]},
    entry_points={"console_scripts": ["sparse-ckpt-bench = sparse_ckpt.bench.run:console_main"]},
    ext_modules=[CMakeExtension("sparse_ckpt._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    # the floor .ci/run tests (its "torch floor" stage); torch 2.6's dcp.save/load have no no_dist
    install_requires=["torch>=2.7", "numpy", "safetensors>=0.4"],
    extras_require={
        # the tests build the core themselves too (wheel, setup.py and sanitizer tests): its build tools
        "test": ["pytest", "hypothesis", "ruff", "setuptools>=64", "wheel", "pybind11>=2.12", "cmake>=3.18", "ninja"],
        "bench": ["matplotlib>=3.7", "tqdm"],  # 3.7: fig.legend(loc="outside ...")
        "npu": ["torch-npu"],
    },
    zip_safe=False,
)
