#!/usr/bin/env bash
# One GPU session's measurements (issue 16), for the device machine: install this checkout
# into the image's torch/Triton, run the kernel suite and the model-level run with time budgets
# that leave room for a rerun, copy the JSON to $OUT (the device tool brings it back).
#   bash bench/gpu_run.sh [suite-budget-s] [model-budget-s]
set -uo pipefail
cd "$(dirname "$0")/.."
SUITE_S="${1:-240}"
MODEL_S="${2:-200}"
export TRITON_DEFAULT_FP_FUSION=1
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
python bench/gpu_suite.py --budget-s "$SUITE_S" || rc=$?
python bench/gpu_model.py --budget-s "$MODEL_S" || rc=$?
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && cp -v bench/results/gpu_suite_*.json bench/results/gpu_model_*.json "$OUT"/ 2>/dev/null
fi
exit $rc
