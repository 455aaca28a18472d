#!/usr/bin/env bash
# gpu_kl.sh: the GPU checks of the full-vocabulary KL (issue 5), as one command.
#
# Why this file exists: GPU time is scarce, so the tier-3 KL tests and the KL benchmark run
# together, from one prepared script. Run from anywhere on a CUDA machine with torch and CuPy
# (`import cupy`); the package need not be installed (a namespace shim is made if
# `import mopd.kernels` fails). Writes:
#   $OUT/kl/kl.log                      environment, test output, benchmark table
#   $OUT/kl/kl-<gpu>-<date>.{csv,md}    the benchmark, via mopd.profiling.results.record
# With $OUT unset, the log goes to ./gpu-out/kl/ and the results to profiling/results/.
# Exit status: non-zero if the tests or the benchmark failed (the benchmark runs regardless).
# Expected wall time on an H200: about 2 minutes (NVRTC compiles kl_kernels.cu once, ~10 s).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ -n "${OUT:-}" ]; then
  DEST="$OUT/kl"
  RESULTS=(--results-dir "$DEST")
else
  DEST="$ROOT/gpu-out/kl"
  RESULTS=()
fi
mkdir -p "$DEST"
LOG="$DEST/kl.log"
: >"$LOG"

if ! "$PY" -c "import mopd.kernels" 2>/dev/null; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/mopd"
  for d in capture bridge kernels profiling; do ln -s "$ROOT/$d" "$SHIM/mopd/$d"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  echo "mopd not installed: using a namespace shim at $SHIM" >>"$LOG"
fi
export PYTHONUNBUFFERED=1

{
  echo "== environment ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  "$PY" - <<'PYEOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as exc:
    print("cupy unusable:", exc)
PYEOF
} >>"$LOG" 2>&1

echo "== tier-3 KL tests" >>"$LOG"
timeout --kill-after=10 300 "$PY" -m pytest -q -rs -p no:cacheprovider -o addopts= \
  tests/gpu/test_kl_gpu.py >>"$LOG" 2>&1
TEST_RC=$?
echo "== tests exit status: $TEST_RC" >>"$LOG"

echo "== benchmark" >>"$LOG"
timeout --kill-after=10 240 "$PY" -m mopd.profiling.bench_kl "${RESULTS[@]}" >>"$LOG" 2>&1
BENCH_RC=$?
echo "== benchmark exit status: $BENCH_RC" >>"$LOG"

tail -n 60 "$LOG"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
