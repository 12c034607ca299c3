#!/usr/bin/env bash
# The GPU test suite and the benchmarks on CUDA, recording the figures; under 8 minutes.
#   bash benchmarks/gpu.sh            (PYTHON=... to choose the interpreter; default .venv/bin/python, else python3)
# Writes benchmarks/results/gpu-<UTC stamp>-{env,tests,bench}.txt and gpu-<stamp>.json.  Without a CUDA
# device it says so and exits 0 (safe to run anywhere).  Budget: tests <= 4 min, benchmarks <= 3.5 min.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "benchmarks/gpu.sh: $PY cannot import torch (run ./dev setup first, or set PYTHON); nothing run" >&2
  exit 0
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "benchmarks/gpu.sh: no CUDA device visible to $PY (torch.cuda.is_available() is False); nothing run" >&2
  exit 0
fi
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" BENCH_THREADS="${BENCH_THREADS:-8}"
out=benchmarks/results
mkdir -p "$out"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} | tee "$out/gpu-$stamp-env.txt"
# every test parametrized over the device fixture (tests/conftest.py adds "cuda" when a GPU is present)
timeout 240 "$PY" -m pytest tests -q -p no:cacheprovider -k cuda 2>&1 | tail -n 40 | tee "$out/gpu-$stamp-tests.txt" || status=1
# the benchmark grid on CUDA (GroMo rows are CPU-only); ratios to a plain pass of the same run
PYTHONPATH=. timeout 210 "$PY" benchmarks/speed_matrix.py --quick --device cuda --reps 3 --json "$out/gpu-$stamp.json" \
  2>&1 | tee "$out/gpu-$stamp-bench.txt" || status=1
echo "benchmarks/gpu.sh: figures in $out/gpu-$stamp-*.txt (status $status)"
exit "$status"
