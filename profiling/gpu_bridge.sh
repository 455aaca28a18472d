#!/usr/bin/env bash
# gpu_bridge.sh: the GPU checks of the bridge (issue 3), as one command.
#
# Why this file exists: GPU time is scarce, so the tier-3 bridge tests (NCCL at world size 1,
# CUDA tensors: colocated local copies, NCCL send/recv to self, the LM-head reshard) and the
# bridge benchmark run together, from one prepared script. Run from anywhere on a CUDA machine
# with torch (CuPy optional: the kernels fall back to their torch twins); the package need not be
# installed (a namespace shim is made if `import mopd.bridge` fails). Writes:
#   $OUT/bridge/bridge.log                    environment, test output, benchmark tables
#   $OUT/bridge/bridge-<gpu>-<date>.{csv,md}  the benchmark, via mopd.profiling.results.record
# With $OUT unset, everything goes to ./gpu-out/bridge/.
# Exit status: non-zero if the tests or the benchmark failed (the benchmark runs regardless).
# Expected wall time on an H200: about 1-2 minutes (CuPy compiles the row kernels once).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEST="${OUT:-$ROOT/gpu-out}/bridge"
mkdir -p "$DEST"
LOG="$DEST/bridge.log"
: >"$LOG"

if ! "$PY" -c "import mopd.bridge" 2>/dev/null; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/mopd"
  for d in capture bridge kernels profiling; do ln -s "$ROOT/$d" "$SHIM/mopd/$d"; done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  echo "mopd not installed: using a namespace shim at $SHIM" >>"$LOG"
fi
export PYTHONUNBUFFERED=1

{
  echo "== environment ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" 2>&1
} >>"$LOG" 2>&1

echo "== tier-3 bridge tests" >>"$LOG"
timeout 240 "$PY" -m pytest -q -rA -p no:cacheprovider -o addopts= tests/gpu/test_bridge_gpu.py >>"$LOG" 2>&1
TEST_RC=$?
echo "== tests exit status: $TEST_RC" >>"$LOG"

echo "== benchmark (NCCL, world size 1)" >>"$LOG"
timeout 240 "$PY" -m mopd.profiling.bench_bridge --results-dir "$DEST" >>"$LOG" 2>&1
BENCH_RC=$?
echo "== benchmark exit status: $BENCH_RC" >>"$LOG"

tail -n 60 "$LOG"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
