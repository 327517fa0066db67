#!/usr/bin/env bash
# Re-measure every JSON file docs/results.md reads (bench/results/), each recording its provenance,
# then re-render the page, its plots, bench/results/results.md and its figures, and scale.svg.
#
#   bash bench/refresh_results.sh                     # everything: ~39 min on a quiet 2-core machine
#   bash bench/refresh_results.sh titan_compare.json  # only the named files, then the page
#   bash bench/refresh_results.sh --smoke DIR         # tiny sizes into DIR (a copy of the page and its
#                                                     # plots into DIR/page): the commands work; the
#                                                     # figures mean nothing
#
# Run it on a quiet machine (load average well under 1: it prints the load first and each result
# records its load before and after). Each step prints its command, estimate and time taken; the
# script stops at the first failure. bench/README.md ("Refreshing the results") says what each file
# is measured with; `python -m bench.results_page --check` names this script and the file to rerun
# when a result lacks provenance or predates the package's default layout or format.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

OUT=bench/results PAGE=docs/results.md IMG=docs/img SMOKE=
if [[ ${1:-} == --smoke ]]; then
    [[ -n ${2:-} ]] || { echo "usage: $0 --smoke DIR [FILE.json ...]" >&2; exit 2; }
    SMOKE=1 OUT=$2 PAGE=$2/page/results.md IMG=$2/page/img
    shift 2
    mkdir -p "$OUT/page"
    cp docs/results.md "$PAGE"
    cp bench/results/*.json "$OUT/"  # the files not re-measured, for the page (the check then names them)
fi

# One step per JSON file, in this order (the cheap and the quiet-sensitive ones first). FULL is the
# measurement; SMALL the same command at tiny sizes (--smoke); EST the expected minutes on 2 quiet cores.
ORDER=(hot_path.json dsd_trainer.json veomni_checkpointer.json results.json scale_dcp.json
    scale_dcp_spread.json scale_metadata.json titan_compare.json)
declare -A FULL SMALL EST
FULL[hot_path.json]='python -m bench.hot_path --rounds 21 --out "$OUT/hot_path.json"'
SMALL[hot_path.json]='python -m bench.hot_path --scale 4x16 --rounds 3 --out "$OUT/hot_path.json"'
EST[hot_path.json]=1
FULL[dsd_trainer.json]='python -m bench.dsd_trainer --repeats 11 --json "$OUT/dsd_trainer.json"'
SMALL[dsd_trainer.json]='python -m bench.dsd_trainer --repeats 1 --json "$OUT/dsd_trainer.json"'
EST[dsd_trainer.json]=1
FULL[veomni_checkpointer.json]='python -m bench.veomni_checkpointer --repeats 5 --json "$OUT/veomni_checkpointer.json"'
SMALL[veomni_checkpointer.json]='python -m bench.veomni_checkpointer --layers 1 --experts 4 --dim 8 --repeats 1
    --json "$OUT/veomni_checkpointer.json"'
EST[veomni_checkpointer.json]=1
FULL[results.json]='python -m bench --scales 8x64,24x128,61x256 --repeats 3 --budget 5 --dcp-max-items 130000
    --floor-load-max-groups 10000 --floor-load-max-params 50000 --dsd-set-max-groups 10000 --dsd-max-params 50000
    --progress lines --out "$OUT"'
SMALL[results.json]='python -m bench --scales 61x256 --repeats 1 --budget 0.1 --methods floor/state_dict,dsd/get
    --progress lines --out "$OUT"'
EST[results.json]=14
FULL[scale_dcp.json]='python -m bench.scale dcp --fixtures 24x128:h0,24x128:h64,4x16:h512,8x64:h64:e32768x64
    --repeats 11 --threads 1 --out "$OUT/scale_dcp.json"'
SMALL[scale_dcp.json]='python -m bench.scale dcp --fixtures 2x8:h0 --repeats 1 --threads 1 --out "$OUT/scale_dcp.json"'
EST[scale_dcp.json]=6
FULL[scale_dcp_spread.json]='python -m bench.scale dcp --fixtures 24x128:h64 --repeats 15 --threads 1 --spread
    --out "$OUT/scale_dcp_spread.json"'
SMALL[scale_dcp_spread.json]='python -m bench.scale dcp --fixtures 2x8:h0 --repeats 2 --threads 1 --spread
    --out "$OUT/scale_dcp_spread.json"'
EST[scale_dcp_spread.json]=7
FULL[scale_metadata.json]='python -m bench.scale metadata --fixture 61x256:h0:e32768x64 --ranks 8,64,256,1024
    --max-records 400000 --repeats 1 --check 16 --check-sample 4 --out "$OUT/scale_metadata.json"'
SMALL[scale_metadata.json]='python -m bench.scale metadata --fixture 2x8:h0 --ranks 8,64 --repeats 1
    --out "$OUT/scale_metadata.json"'
EST[scale_metadata.json]=3
FULL[titan_compare.json]='python -m bench.titan_compare --repeat 3 --out "$OUT/titan_compare.json"'
SMALL[titan_compare.json]='python -m bench.titan_compare --layers 1 --experts 4 --dim 8 --repeat 1
    --out "$OUT/titan_compare.json"'
EST[titan_compare.json]=7

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=("${ORDER[@]}")
for name in "${steps[@]}"; do
    [[ -n ${FULL[$name]+x} ]] || { echo "unknown result file: $name (one of: ${ORDER[*]})" >&2; exit 2; }
done

echo "refresh_results: ${#steps[@]} file(s) into $OUT; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?');" \
    "load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
if [[ -z $SMOKE ]] && awk '{exit !($1 > 1.0)}' /proc/loadavg 2>/dev/null; then
    echo "warning: the load average is above 1: the figures will show it (each file records it)" >&2
fi
start=$(date +%s)
i=0
run_step() {  # $1: label, $2: command (expanded here, with $OUT)
    local t0 cmd
    t0=$(date +%s)
    cmd=$(eval "echo $2")
    echo
    echo "== $1: $cmd"
    eval "$2"
    echo "== $1: done in $(($(date +%s) - t0)) s (total $(($(date +%s) - start)) s)"
}
for name in "${steps[@]}"; do
    i=$((i + 1))
    cmd=${FULL[$name]}
    [[ -z $SMOKE ]] || cmd=${SMALL[$name]}
    run_step "[$i/${#steps[@]}] $name (~${EST[$name]} min)" "${cmd//$'\n'/ }"
done
run_step "scale.svg" 'python -m bench.scale report "$OUT/scale_dcp.json" "$OUT/scale_metadata.json" --svg "$OUT/scale.svg"'
run_step "docs/results.md and its plots" 'python -m bench.results_page --results "$OUT" --page "$PAGE" --img "$IMG"'
run_step "check" 'python -m bench.results_page --check --results "$OUT" --page "$PAGE"'
echo
echo "refresh_results: all done in $(($(date +%s) - start)) s; review and commit bench/results/, docs/results.md and docs/img/"
