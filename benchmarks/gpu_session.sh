#!/usr/bin/env bash
# The one command of a session lent a GPU (docs/performance.md, "When a GPU is lent"):
#
#     bash benchmarks/gpu_session.sh        # the device tool's run: carry [".whl"], timeout_s 600
#
# Installs the carried wheels (.whl, made here by benchmarks/gpu_wheels.py) into /tmp/site, puts
# src on PYTHONPATH (no editable install: no build backend offline), prints the versions, runs the
# smoke (benchmarks/gpu.py --smoke: does everything run there?), then the benchmark with the time
# left, its cases those the smoke did not see fail. Everything is teed to $OUT/log.txt; the tables
# land in $OUT/smoke.md and $OUT/gpu.md. Ends within SESSION_BUDGET_S (560 s) of its start.
# SMOKE=0 skips the smoke (a second call on the warm machine: the benchmark with the whole budget).
#
# For a dry run on a CPU: OUT=/tmp/gpu-out PYTHON=.venv/bin/python WHEELS=none SESSION_BUDGET_S=120 \
#   SMOKE_ARGS="--device cpu --size tiny --no-compile" BENCH_ARGS="--device cpu --size tiny --no-compile" \
#   bash benchmarks/gpu_session.sh
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-./gpu-out}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
TOTAL_S=${SESSION_BUDGET_S:-560}      # the whole script; the tool's limit is 600 s
SMOKE_LIMIT_S=${SMOKE_LIMIT_S:-230}   # the smoke's own budget is 170 s, checked between cases
MARGIN_S=60                           # a case's compile may start just before the benchmark's budget ends
# the benchmark's cases, most wanted first: a case whose turn comes too late is left out
CASES=${GPU_CASES:-pre,siamese,siamese-kernels,pre-kernels,siamese-hybrid_pre,mhc,hyper,attn_res,attn_res-block4,pre-value_residual,olmo-core-pre,olmo-core-siamese}
read -r -a SMOKE_EXTRA <<<"${SMOKE_ARGS:-}"
read -r -a BENCH_EXTRA <<<"${BENCH_ARGS:-}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

stage_name=""
stage_start=0
stage() {   # the time of the stage that ends, and the next one's title
    [ -n "$stage_name" ] && echo "== ${stage_name}: took $((SECONDS - stage_start)) s"
    stage_name=$1
    stage_start=$SECONDS
    echo
    echo "== [${SECONDS} s] $1"
}

session() {
    stage "versions"
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
        || echo "nvidia-smi: not available"
    echo "cores: $(nproc)"
    "$PY" - <<'EOF'
import platform
import torch
print(f"python {platform.python_version()}; torch {torch.__version__}; CUDA {torch.version.cuda}; "
      f"cuDNN {torch.backends.cudnn.version()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except Exception as error:
    print(f"triton does not import: {error}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}: {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
          f"{p.multi_processor_count} SMs")
else:
    print("no CUDA device")
EOF

    stage "wheels ($WHEELS -> $SITE)"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        ls "$WHEELS"/*.whl | wc -l | xargs echo "wheels:"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl || echo "WHEELS FAILED to install: OLMo-core's cases will fail"
    else
        echo "no $WHEELS/*.whl carried: OLMo-core's cases are left out unless the image has it"
    fi
    export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    [ -d "$WHEELS" ] && "$PY" benchmarks/gpu_wheels.py --image-report --dest "$WHEELS"
    "$PY" -c "import siamesenorm; print('siamesenorm from', siamesenorm.__file__)"
    "$PY" -c "import olmo_core.version as v, siamesenorm.olmo_core; print('olmo_core', v.VERSION, 'imports')" \
        || echo "OLMo-core DOES NOT IMPORT"

    local smoke=skipped
    rm -f "$OUT/smoke-ok.txt"
    if [ "${SMOKE:-1}" = 0 ]; then
        echo "SMOKE=0: no smoke; the benchmark takes the whole budget"
    else
        stage "smoke (benchmarks/gpu.py --smoke, at most ${SMOKE_LIMIT_S} s)"
        timeout -k 10 "$SMOKE_LIMIT_S" "$PY" benchmarks/gpu.py --smoke --markdown "$OUT/smoke.md" \
            --ok-cases "$OUT/smoke-ok.txt" --tracebacks "$OUT/smoke-tracebacks.txt" "${SMOKE_EXTRA[@]}"
        smoke=$?
    fi
    case $smoke in
        0) echo "smoke: every row ok" ;;
        1) echo "SMOKE: some rows failed or were skipped (above); the benchmark runs the cases that did not fail" ;;
        skipped) ;;
        124 | 137) echo "SMOKE TIMED OUT after ${SMOKE_LIMIT_S} s: the benchmark runs every case" ;;
        *) echo "SMOKE CRASHED (exit $smoke): the benchmark runs every case" ;;
    esac
    local cases=$CASES
    if [ -s "$OUT/smoke-ok.txt" ]; then
        local ok
        ok=",$(tr -d '\n' <"$OUT/smoke-ok.txt"),"
        cases=""
        for c in ${CASES//,/ }; do
            if [[ $ok == *",$c,"* ]]; then cases="$cases${cases:+,}$c"; else echo "left out (failed in the smoke): $c"; fi
        done
    fi

    local left=$((TOTAL_S - SECONDS))
    local budget=$((left - MARGIN_S))
    [ "$budget" -lt 60 ] && budget=60
    stage "benchmark (benchmarks/gpu.py --budget-s $budget, $left s left)"
    if [ -z "$cases" ]; then cases=pre; fi
    timeout -k 10 "$((left + 20))" "$PY" benchmarks/gpu.py --cases "$cases" --budget-s "$budget" \
        --markdown "$OUT/gpu.md" "${BENCH_EXTRA[@]}"
    local bench=$?
    [ $bench -eq 0 ] || echo "BENCHMARK FAILED (exit $bench)"

    stage "done"
    echo "smoke exit $smoke, benchmark exit $bench, ${SECONDS} s in all"
    ls -l "$OUT"
    return $bench
}

session 2>&1 | tee "$OUT/log.txt"
