#!/usr/bin/env bash
# Issue 23's device checks, as run on one H200 host (16 CPU cores): build the C++ core, run the
# CUDA and the spawned multi-rank tests (both core backends), and time bench.scale's dcp mode on
# the host's CPU and on its GPU. Figures go to $OUT (JSON), the test log too.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sparse_ckpt_device}
mkdir -p "$OUT"
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=$PWD SPARSE_CKPT_REQUIRE_CPP=1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_buffers_cuda.py tests/test_buffers_multirank.py \
    tests/test_stable_keys.py 2>&1 | tee "$OUT/tests.log" | tail -15
for dev in cpu cuda; do
    python3 -m bench.scale dcp --scale 24x128 --hidden 0,64 --repeats 3 --device $dev --out "$OUT/dcp_24x128_$dev.json"
    python3 -m bench.scale dcp --scale 4x16 --hidden 512 --repeats 3 --device $dev --out "$OUT/dcp_4x16x512_$dev.json"
done
