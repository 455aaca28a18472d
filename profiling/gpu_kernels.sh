#!/usr/bin/env bash
# gpu_kernels.sh: the GPU checks of the row kernels (issue 4), as one command.
#
# Why this file exists: GPU time is scarce, so the tier-3 kernel tests and the kernel benchmark
# run together, from one prepared script. Run from anywhere on a CUDA machine with torch and
# CuPy (`import cupy`); the package need not be installed (a namespace shim is made if
# `import mopd.kernels` fails). Writes three files:
#   $OUT/kernels/kernels.log                   environment, test output, benchmark table
#   $OUT/kernels/kernels-<gpu>-<date>.{csv,md} the benchmark, via mopd.profiling.results.record
# With $OUT unset, the log goes to ./gpu-out/kernels/ and the results to profiling/results/.
# Exit status: non-zero if the tests failed (the benchmark runs regardless).
# Expected wall time on an H200: about 1-2 minutes: NVRTC compiles rows.cu once in two modules
# (vector and bulk kernels, ~10-40 s, then CuPy's disk cache), ~1200 tier-3 tests (the bulk
# variants' last), the benchmark (all variants, median of 15) well under a minute.
# The benchmark prints each row as it is measured, then the table and a summary line naming the
# best variant per op as a DEFAULT_VARIANTS dict (for kernels/cupy_rows.py).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -n "${OUT:-}" ]; then
  DEST="$OUT/kernels"
  RESULTS=(--results-dir "$DEST")
else
  DEST="$ROOT/gpu-out/kernels"
  RESULTS=()
fi
mkdir -p "$DEST"
LOG="$DEST/kernels.log"
: >"$LOG"

if ! "$PY" -c "import mopd.kernels" 2>/dev/null; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/mopd"
  for d in capture bridge kernels profiling; do ln -s "$ROOT/$d" "$SHIM/mopd/$d"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  echo "mopd not installed: using a namespace shim at $SHIM" >>"$LOG"
fi

{
  echo "== environment ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  "$PY" - <<'EOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as exc:
    print("cupy unusable:", exc)
from mopd.kernels.cupy_rows import DEFAULT_VARIANTS, VARIANTS
print("variants", VARIANTS, "defaults", DEFAULT_VARIANTS)
print("device", torch.cuda.get_device_name(0), "sm", torch.cuda.get_device_capability(0))
EOF
} >>"$LOG" 2>&1

echo "== tier-3 kernel tests (+ tier-1 rows tests)" >>"$LOG"
timeout 420 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_kernels_gpu.py tests/unit/test_kernels_rows.py >>"$LOG" 2>&1
TEST_RC=$?
echo "== tests exit status: $TEST_RC" >>"$LOG"

echo "== benchmark" >>"$LOG"
timeout 300 "$PY" -m mopd.profiling.bench_kernels "${RESULTS[@]}" >>"$LOG" 2>&1
BENCH_RC=$?
echo "== benchmark exit status: $BENCH_RC" >>"$LOG"

tail -n 60 "$LOG"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
