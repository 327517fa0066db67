#!/usr/bin/env bash
# Build the C++ core (sparse_ckpt._C) once with AddressSanitizer + UndefinedBehaviorSanitizer in
# a throw-away directory and run the core tests against it, C++ backend only:
#   tests/core/test_core_differential.py  (C++ vs Python twin, on random and edge-case inputs)
#   tests/core/test_core_layouts.py       (the layout codec and scatter plan, differential and fuzzed)
#   tests/load/test_bad_checkpoints.py    (every defect through the load path; decode_table /
#                                          unflatten fuzzed with random and mutated inputs)
# Any sanitizer report fails the script. The repository's own build (sparse_ckpt/_C*.so) is
# neither used nor touched: the package and the tests are copied next to the sanitized module.
#
# Usage: bash .ci/sanitize.sh      (env: PYTHON=python3, CXX=g++, SANITIZE_KEEP=1 keeps the dir)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
CXX="${CXX:-g++}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/sparse_ckpt_sanitize.XXXXXX")"
cleanup() { if [ -z "${SANITIZE_KEEP:-}" ]; then rm -rf "$WORK"; else echo "kept $WORK"; fi; }
trap cleanup EXIT

# --- build tools (CI installs the package with build isolation, so they may be missing here) --
if ! "$PY" -c "import pybind11" 2>/dev/null || { ! command -v cmake >/dev/null && ! "$PY" -c "import cmake" 2>/dev/null; } \
   || { ! command -v ninja >/dev/null && ! "$PY" -c "import ninja" 2>/dev/null; }; then
  "$PY" -m pip install -q "pybind11>=2.12" "cmake>=3.18" ninja
fi
CMAKE="$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null || command -v cmake)"
NINJA="$("$PY" -c 'import ninja, os; print(os.path.join(ninja.BIN_DIR, "ninja"))' 2>/dev/null || command -v ninja)"
[ -x "$CMAKE" ] || CMAKE="$(command -v cmake)"
[ -x "$NINJA" ] || NINJA="$(command -v ninja)"

# --- sanitizer runtimes: the ones of the compiler that builds the module --------------------
ASAN_RT="$("$CXX" -print-file-name=libasan.so)"
UBSAN_RT="$("$CXX" -print-file-name=libubsan.so)"
for rt in "$ASAN_RT" "$UBSAN_RT"; do
  if [ ! -e "$rt" ]; then
    echo "sanitize.sh: $CXX has no sanitizer runtime ($rt); install libasan/libubsan" >&2
    exit 1
  fi
done

# --- a private copy of the package and the tests, without any prebuilt _C ------------------
TREE="$WORK/tree"
mkdir -p "$TREE"
cp -r "$ROOT/sparse_ckpt" "$ROOT/tests" "$ROOT/bench" "$TREE/"  # tests import bench (ranks) via conftest
[ -f "$ROOT/pyproject.toml" ] && cp "$ROOT/pyproject.toml" "$TREE/"
rm -f "$TREE"/sparse_ckpt/_C*.so "$TREE"/sparse_ckpt/_C*.pyd
find "$TREE" -name __pycache__ -type d -prune -exec rm -rf {} +

# --- one sanitized build, straight from CMakeLists.txt --------------------------------------
# -O0 -g1: line numbers in reports and a third of the compile time of -O2 -g (pybind11
# translation units are slow to build; the sanitizers instrument every access at any -O). CMakeLists.txt adds -fsanitize=address,undefined
# -fno-omit-frame-pointer -fno-sanitize-recover=undefined.
echo "== sanitized build of sparse_ckpt._C in $WORK/build"
"$CMAKE" -S "$ROOT" -B "$WORK/build" -G Ninja \
  -DCMAKE_MAKE_PROGRAM="$NINJA" \
  -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g1" \
  -DPython_EXECUTABLE="$(command -v "$PY")" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
  -DSPARSE_CKPT_OUTPUT_DIR="$TREE/sparse_ckpt" \
  -DSPARSE_CKPT_SANITIZE=ON > "$WORK/cmake.log" || { cat "$WORK/cmake.log"; exit 1; }
"$CMAKE" --build "$WORK/build" --parallel "$(nproc 2>/dev/null || echo 2)"
SO="$(ls "$TREE"/sparse_ckpt/_C*.so)"
ldd "$SO" > "$WORK/ldd.txt"  # (not piped into grep -q: with pipefail, an early exit fails the pipe)
if ! grep -q libasan "$WORK/ldd.txt"; then
  echo "sanitize.sh: $SO is not linked against ASan (is SPARSE_CKPT_SANITIZE honoured by CMakeLists.txt?)" >&2
  exit 1
fi

# --- run the core tests under the sanitizers ------------------------------------------------
# detect_leaks=0: CPython (and torch) never free much of what they allocate -- interned
# strings, type objects, arenas, static singletons -- so LeakSanitizer would report thousands
# of interpreter "leaks" at exit that are not ours. Memory errors (overflow, use-after-free,
# double free, ...) are still fatal. UBSan stops at the first report (the module is also built
# with -fno-sanitize-recover=undefined). Reports also go to $WORK/reports.*, and any file there
# fails the run, even if a report somehow did not abort the process.
mkdir -p "$WORK/reports"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$WORK/reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$WORK/reports/ubsan"
export SPARSE_CKPT_BACKEND=cpp SPARSE_CKPT_REQUIRE_CPP=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"

# Self-test of the harness: a deliberate heap overflow (through ASan's memmove interceptor) must
# abort and leave a report, or a clean run below would prove nothing.
mkdir -p "$WORK/selftest"
if ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$WORK/selftest/asan" \
   LD_PRELOAD="$ASAN_RT:$UBSAN_RT" "$PY" -c "
import ctypes
src, dst = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(8192)
ctypes.memmove(dst, src, 5000)
" 2>/dev/null || ! compgen -G "$WORK/selftest/asan*" > /dev/null; then
  echo "sanitize.sh: the ASan harness did not catch a deliberate heap overflow" >&2
  exit 1
fi

# The same for UBSan: a deliberate signed overflow in a program built with the module's UBSan
# flags must stop it and leave a report.
cat > "$WORK/selftest/ub.cpp" <<'CPP'
#include <climits>
int main(int argc, char**) { int x = INT_MAX; x += argc; return x == 0; }
CPP
"$CXX" -O0 -fsanitize=undefined -fno-sanitize-recover=undefined "$WORK/selftest/ub.cpp" -o "$WORK/selftest/ub"
if UBSAN_OPTIONS="halt_on_error=1:log_path=$WORK/selftest/ubsan" "$WORK/selftest/ub" 2>/dev/null \
   || ! compgen -G "$WORK/selftest/ubsan*" > /dev/null; then
  echo "sanitize.sh: the UBSan harness did not catch a deliberate signed overflow" >&2
  exit 1
fi

cd "$TREE"  # the package imported below is the copy holding the sanitized module
LD_PRELOAD="$ASAN_RT:$UBSAN_RT" "$PY" -c "
import sparse_ckpt._C as c, sparse_ckpt._backend as b
assert c.__file__.startswith('$TREE'), c.__file__
assert b.NAME == 'cpp', b.NAME
print('sanitized core:', c.__file__)
"

set +e
SANITIZE_TESTS=(
  tests/core/test_core_differential.py tests/core/test_core_layouts.py tests/load/test_bad_checkpoints.py
  tests/load/test_load_semantics.py tests/load/test_load_errors.py tests/load/test_round_trip_exactness.py
  tests/dcp/test_dcp_single.py tests/save/test_save_hooks.py tests/safety/test_concurrency.py
)
# (the address-space-limit test starts a child that would inherit the sanitizer runtime, whose
# shadow memory cannot fit under that limit)
LD_PRELOAD="$ASAN_RT:$UBSAN_RT" "$PY" -m pytest -q -p no:cacheprovider -k cpp \
  --deselect "tests/load/test_bad_checkpoints.py::test_huge_length_fields_under_address_space_limit[cpp]" \
  -W "ignore:torch.distributed is disabled:UserWarning" "${SANITIZE_TESTS[@]}"
rc=$?
set -e

if compgen -G "$WORK/reports/*" > /dev/null; then
  echo "sanitize.sh: sanitizer reports:" >&2
  cat "$WORK"/reports/* >&2
  exit 1
fi
if [ "$rc" -eq 5 ]; then
  echo "sanitize.sh: no tests collected" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "sanitize.sh: core tests failed under ASan/UBSan (exit $rc)" >&2
  exit "$rc"
fi
echo "sanitize.sh: ${SANITIZE_TESTS[*]} passed under ASan/UBSan with no reports"
