#!/usr/bin/env bash
# One prepared run of every GPU check, for a lent GPU machine (one H200 in this project's case):
# the tier-3 tests of every package, then the benchmarks, each bounded in time, with logs and
# result files packed into $OUT/gpu_session.tgz (default ./gpu-out). Run from the repository root:
#
#   bash profiling/gpu_session.sh            # everything
#   ONLY="tests kernels" TESTS=tests/gpu/test_kernels_gpu.py bash profiling/gpu_session.sh
#
# Python packages missing on the machine (megatron-core, nvtx) are installed from ./.whl when that
# folder exists (wheels for the machine's Python), since such a machine reaches no registry. Fetch
# them beforehand where pip works, for the GPU machine's Python (3.12 on the H200 image):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     megatron-core==0.16.1 nvtx==0.2.17
# With the device tool, name `.whl` in carry (it is git-ignored) and give timeout_s >= BUDGET + 60.
# Parts (ONLY): env, tests (TESTS: the tier-3 files, default all), kernels, kl, bridge, capture,
# ranges (with nsys.sh's check), demo (the MOPD demo on NCCL at world size 1), worlds (the
# bridge across two worlds beside the host path; Ray from .whl; its ranks on gloo).
# BUDGET (seconds, default 480) bounds the whole run: each part's limit is cut to what is left,
# and the archive is rewritten after every part (and on exit), so a run cut short still returns
# everything finished so far. The parts' own limits add up to more than BUDGET on purpose: the
# default order puts the most wanted first (the kernel benchmark, then every tier-3 test), so a
# slow run loses the nice-to-haves at the end. With 15 device minutes, BUDGET=480 leaves room for
# the machine's start and one shorter rerun.
set -uo pipefail
FINAL=${OUT:-$PWD/gpu-out}
OUT=$(mktemp -d)  # everything is written here, then packed into $FINAL/gpu_session.tgz
mkdir -p "$FINAL"
ONLY=${ONLY:-"env kernels tests kl bridge demo capture ranges worlds"}  # most wanted first: BUDGET may cut the tail
BUDGET=${BUDGET:-480}
TESTS=${TESTS:-tests/gpu}
PY=${PYTHON:-python3}
SITE=/tmp/mopd-site
start=$(date +%s)
log() { echo "[gpu_session +$(( $(date +%s) - start ))s] $*"; }
pack() { tar czf "$FINAL/.gpu_session.tgz" -C "$OUT" . 2>/dev/null && mv "$FINAL/.gpu_session.tgz" "$FINAL/gpu_session.tgz"; }
trap pack EXIT

rm -rf "$SITE" build  # a warm machine keeps /tmp: never test the previous run's install

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || log "wheel install failed"
fi
# the project itself, as a regular install (setuptools from the image, no index)
$PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . || { log "project install failed"; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd /tmp && $PY -c "import mopd.kernels, mopd.capture; print('mopd from', mopd.kernels.__file__)"; cd - >/dev/null

status=0
run() {  # run NAME TIMEOUT CMD... (the limit is cut to what is left of BUDGET)
    local name=$1 t=$2; shift 2
    local left=$(( BUDGET - ($(date +%s) - start) - 10 ))
    if [ "$left" -lt 5 ]; then log "skip $name: BUDGET spent"; status=1; return; fi
    [ "$t" -le "$left" ] || t=$left
    log "start $name (limit ${t}s)"
    timeout --kill-after=10 "$t" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    log "end $name rc=$rc"; tail -n 25 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
    pack
}

for part in $ONLY; do
    case $part in
    env) run env 30 bash -c "nvidia-smi; $PY -c 'import torch, cupy; print(torch.__version__, torch.version.cuda, cupy.__version__, torch.cuda.get_device_name(0))'" ;;
    tests) run tests 180 $PY -m pytest $TESTS -q -rs -p no:cacheprovider -o addopts= --timeout 120 ;;
    kernels) run bench_kernels 90 $PY -m mopd.profiling.bench.kernels --results-dir "$OUT" ;;
    # kl: speed and memory at T=8192, H=4096, V=151936 bf16 against the matmul floor and the
    # peers (Liger-Kernel too where its wheel was installed from .whl), then the numerics sweep
    kl) run bench_kl 150 $PY -m mopd.profiling.bench.kl --tokens 8192 --results-dir "$OUT" ;;
    bridge) run bench_bridge 60 $PY -m mopd.profiling.bench.bridge --results-dir "$OUT" ;;
    capture) run bench_capture 45 $PY -m mopd.profiling.bench.capture --results-dir "$OUT" ;;
    ranges) run bench_ranges 30 $PY -m mopd.profiling.bench.ranges --iters 20000 --results-dir "$OUT"
            # nsys is not on that image: expect nsys.sh's clear failure (exit 2)
            run nsys_check 15 bash -c "bash profiling/nsys.sh --out '$OUT/nsys' -- $PY -c 'print(1)'; rc=\$?; echo nsys.sh rc=\$rc; command -v nsys >/dev/null || [ \$rc -eq 2 ]" ;;
    demo) run demo 90 $PY -m mopd.profiling.demo --backend nccl --nproc 1 --teacher tp=1 \
              --teacher tp=1 --student tp=1 --steps 3 --trace "$OUT/demo_trace" ;;
    worlds) run bench_worlds 90 $PY -m mopd.profiling.bench.worlds --results-dir "$OUT" ;;
    *) log "unknown part $part"; status=1 ;;
    esac
done
pack && log "done, status $status; $(ls "$OUT" | wc -l) files packed into $FINAL/gpu_session.tgz"
exit $status
