#!/usr/bin/env bash
# The npu stage: the accelerator tests (tests/accelerator/) and `python -m bench --device npu --quick`
# on an emulated `npu` device, in the venv of the Python given (CI's), with the checkout's C++ core.
#
# The device is tests/accelerator/emulated_npu.cpp: this project's own minimal PrivateUse1 backend
# (host memory, two device indices, a pinned host allocator, a device guard, streams and events that never
# wait, torch's boxed CPU fallback for every operator without a native kernel), built here with
# torch.utils.cpp_extension against the installed torch and renamed `npu` with
# torch.utils.rename_privateuse1_backend. It is not PyTorch's OpenReg backend: OpenReg lives only in
# PyTorch's source tree (test/cpp_extensions/open_registration_extension/torch_openreg), which no package
# on PyPI or Debian ships and which CI cannot fetch (docs/npu.md says so, and what that means).
#
# Prints the number of tests that ran on npu (passed, not skipped) and fails when it is zero.
# Usage: bash .ci/npu.sh   (env: PYTHON=python of the venv, default python3; NPU_KEEP=1 keeps the work dir)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/sparse_ckpt_npu.XXXXXX")"
cleanup() { if [ -z "${NPU_KEEP:-}" ]; then rm -rf "$WORK"; else echo "kept $WORK"; fi; }
trap cleanup EXIT
export PYTHONPATH="$ROOT:$ROOT/tests/accelerator${PYTHONPATH:+:$PYTHONPATH}"
export SPARSE_CKPT_NPU_MODULE=emulated_npu SPARSE_CKPT_EMULATED_NPU_BUILD="$WORK/build"
T0=$SECONDS

"$PY" tests/accelerator/emulated_npu.py
echo "npu: emulated device built in $((SECONDS - T0))s"

T1=$SECONDS
set +e
SPARSE_CKPT_TEST_DEVICE=npu SPARSE_CKPT_REQUIRE_CPP=1 "$PY" -m pytest -q -rs -p no:cacheprovider \
  --junitxml="$WORK/npu.xml" tests/accelerator
rc=$?
set -e
echo "npu: tests/accelerator ran in $((SECONDS - T1))s"
"$PY" - "$WORK/npu.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
on_npu = [c for c in cases if "npu" in c.get("name", "")]
ran = [c for c in on_npu if not any(x.tag in ("skipped", "failure", "error") for x in c)]
print(f"npu: {len(ran)} tests ran on npu and passed ({len(on_npu) - len(ran)} npu cases skipped or failed, "
      f"{len(cases)} collected)")
if not ran:
    sys.exit("npu: no test ran on npu")
PY
if [ "$rc" -ne 0 ]; then exit "$rc"; fi

T2=$SECONDS
"$PY" -m bench --device npu --quick --progress lines --out "$WORK/bench" > "$WORK/bench.log" 2>&1 || {
  tail -n 30 "$WORK/bench.log"; exit 1; }
"$PY" - "$WORK/bench" <<'PY'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
results = json.loads((out / "results.json").read_text())
assert results["machine"]["device"] == "npu", results["machine"]
pngs = sorted(p.name for p in out.glob("*.png"))
assert (out / "results.md").exists() and pngs, sorted(p.name for p in out.iterdir())
print(f"npu: bench --device npu --quick wrote results.json, results.md and {', '.join(pngs)} "
      f"(device {results['machine'].get('device_name')})")
PY
echo "npu: bench ran in $((SECONDS - T2))s (stage: $((SECONDS - T0))s)"
