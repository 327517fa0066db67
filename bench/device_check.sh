#!/usr/bin/env bash
# The device check: on a GPU (or NPU) machine with the project copied over, one command
# builds the C++ core in place, runs the accelerator tests (tests/accelerator/, on the --device type), the
# resume drill with --device cuda|npu and the bench with --device cuda|npu at 8x64, 24x128 and 61x256, and writes
# everything into one folder. Needs no network: torch, pybind11, cmake, ninja, setuptools, pytest
# and numpy must be installed (matplotlib optional: without it the bench skips its figures).
#
# Usage: bash bench/device_check.sh [--device cuda|npu|cpu] [--out DIR] [--quick] [--skip-build]
#                                   [--budget SECONDS] [--commit SHA] [--python PY]
#   --device      cuda (default), npu (Ascend: torch_npu installed; the npu type is registered by importing it,
#                 or by the module SPARSE_CKPT_NPU_MODULE names), or cpu: the dry run (CI runs `--device cpu --quick --skip-build`;
#                 the test module then runs on the CPU, SPARSE_CKPT_TEST_DEVICE=cpu)
#   --out         the folder for everything (default: device-check-<device>-<date> in the current directory)
#   --quick       small sizes everywhere (3 of the 11 optimizers in the tests, bench 2x8 with one repeat,
#                 a 4-step drill): a check of the script
#   --skip-build  use the sparse_ckpt/_C already built in the checkout
#   --budget      seconds for the whole run (default 480): each step gets at most what is left, the bench
#                 last (it keeps results.partial.json if cut short)
#   --commit      the commit to record when the copy has no .git (default: git rev-parse HEAD, else "unknown")
#
# Writes into --out: env.txt (machine, GPUs, python, torch, CUDA, commit), build.log, tests.log and
# tests.xml (JUnit), drill.log and drill/ (the drill's run), bench.log and bench/ (results.json,
# results.md, figures), summary.txt (one line per step: PASS/FAIL/SKIP, seconds, log). Exit status:
# 0 when every step passed, 1 otherwise, 2 for bad arguments or a device that is not there.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

DEVICE=cuda OUT="" QUICK=0 BUILD=1 BUDGET=480 COMMIT="" PY="${PYTHON:-python3}"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 ;;
    --out) OUT="${2:-}"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --skip-build) BUILD=0; shift ;;
    --budget) BUDGET="${2:-}"; shift 2 ;;
    --commit) COMMIT="${2:-}"; shift 2 ;;
    --python) PY="${2:-}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|npu|cpu) ;; *) echo "device_check.sh: --device must be cuda, npu or cpu" >&2; exit 2 ;; esac
case "$BUDGET" in ''|*[!0-9]*) echo "device_check.sh: --budget takes whole seconds" >&2; exit 2 ;; esac
OUT="${OUT:-device-check-$DEVICE-$(date +%Y%m%d-%H%M%S)}"
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then echo "device_check.sh: --out $OUT is not empty" >&2; exit 2; fi
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"  # (relative to where the script was started)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
START=$SECONDS
FAILED=0

# How many devices of the kind are present (also fails early when there is none).
COUNT="$("$PY" - "$DEVICE" <<'PY' 2>"$OUT/device.err"
import sys
sys.path.insert(0, ".")
from bench.suite.devices import DeviceUnavailable, device_count
try:
    n = device_count(sys.argv[1])
except DeviceUnavailable as exc:
    sys.exit(f"device_check.sh: {exc}")
print(0 if n is None else n)
PY
)" || { cat "$OUT/device.err" >&2; rm -f "$OUT/device.err"; rmdir "$OUT" 2>/dev/null; exit 2; }
rm -f "$OUT/device.err"
[ -z "$COMMIT" ] && COMMIT="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"

{
  echo "date      $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host      $(uname -a)"
  echo "cpu       $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
  echo "commit    $COMMIT$(git -C "$ROOT" status --porcelain 2>/dev/null | grep -q . && echo ' (with local changes)')"
  echo "device    $DEVICE ($COUNT present)"
  "$PY" - "$DEVICE" <<'PY'
import platform, torch
print(f"python    {platform.python_version()} ({platform.python_implementation()})")
print(f"torch     {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"gpu {i}     {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
import sys
sys.path.insert(0, ".")
from bench.suite.devices import device_name, npu_registered
if npu_registered() or sys.argv[1:] == ["npu"]:
    try:
        print(f"npu       {device_name('npu')}")
    except Exception as exc:  # the device check above already refused a missing npu
        print(f"npu       ? ({exc})")
PY
  command -v nvidia-smi >/dev/null && nvidia-smi 2>&1
  [ "$DEVICE" = npu ] && command -v npu-smi >/dev/null && npu-smi info 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# run_step NAME CAP_SECONDS LOG COMMAND...: run with a timeout of min(CAP, what the budget has left),
# record PASS/FAIL and the seconds in summary.txt.
run_step() {
  local name="$1" cap="$2" log="$3"; shift 3
  local left=$((BUDGET - (SECONDS - START))) t0=$SECONDS rc
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -le 5 ]; then
    printf '%-6s SKIP  %5ss  (budget of %ss spent)\n' "$name" 0 "$BUDGET" | tee -a "$OUT/summary.txt"
    FAILED=1
    return
  fi
  echo "== $name (at most ${limit}s): $*" | tee "$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$log" 2>&1
  rc=$?
  local status=PASS
  [ "$rc" -ne 0 ] && status=FAIL && FAILED=1
  [ "$rc" -eq 124 ] && status="FAIL (timed out after ${limit}s)"
  printf '%-6s %-4s  %5ss  %s (exit %s)\n' "$name" "$status" "$((SECONDS - t0))" "$log" "$rc" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$log"
}

# 1. The C++ core, built in place (no pip, no network).
if [ "$BUILD" -eq 1 ]; then
  run_step build 240 build.log "$PY" setup.py build_ext --inplace --parallel "$(nproc)"
else
  echo "build  SKIP      0s  (--skip-build: the checkout's sparse_ckpt/_C)" | tee -a "$OUT/summary.txt"
fi

# 2. The accelerator tests (both core backends) on the --device type; on the CPU dry run, on the CPU.
TEST_DEVICE="$DEVICE"
TESTS=(tests/accelerator/)
[ "$QUICK" -eq 1 ] && TESTS+=(-k "adamw-fused or adam-for-loop or sgd-fused")
run_step tests 150 tests.log env SPARSE_CKPT_TEST_DEVICE="$TEST_DEVICE" SPARSE_CKPT_REQUIRE_CPP=1 \
  "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/tests.xml" "${TESTS[@]}"

# 3. The resume drill: one rank per GPU (2 where there are two or more), resumed at every size present.
NPROC=2
if [ "$DEVICE" != cpu ] && [ "$COUNT" -lt 2 ]; then NPROC=1; fi
DRILL=(--device "$DEVICE" --nproc "$NPROC" --out "$OUT/drill")
[ "$QUICK" -eq 1 ] && DRILL+=(--steps 4 --every 1)
run_step drill 150 drill.log "$PY" -m bench.resume "${DRILL[@]}"

# 4. The bench: bench/README.md's GPU figures and more, within minutes: torch's load_state_dict (quadratic)
#    only up to 10 000 parameters, DSD's set and the naive and flat DCP layouts left out. On 2 busy CPU
#    cores this list took 620 s with the load at 61x256 layer (115 s of it), which is now skipped.
if [ "$QUICK" -eq 1 ]; then
  BENCH=(--scales 2x8 --repeats 1 --budget 0.5)
else
  BENCH=(--scales 8x64,24x128,61x256 --repeats 3 --budget 5
         --methods floor/,sparse/,dsd/get,dcp/save/packed/stateful,dcp/load/packed/stateful
         --floor-load-max-groups 10000 --floor-load-max-params 10000 --dsd-max-params 50000)
fi
run_step bench 100000 bench.log "$PY" -m bench --device "$DEVICE" "${BENCH[@]}" --progress lines --out "$OUT/bench"

# 5. State layouts on the device: dcp.save/dcp.load in every state layout vs the torch.save floor, at the
#    fixtures of bench/README.md "Scale" (the CPU figures there came from `python -m bench.scale dcp` on the CPU).
if [ "$QUICK" -eq 0 ]; then
  run_step scale 100000 scale.log "$PY" -m bench.scale dcp --fixtures 24x128:h0,24x128:h64,4x16:h512,8x64:h64:e32768x64 \
    --repeats 3 --device "$DEVICE" --out "$OUT/scale_dcp.json"
fi

echo "device_check.sh: $((SECONDS - START))s, everything in $OUT" | tee -a "$OUT/summary.txt"
exit "$FAILED"
