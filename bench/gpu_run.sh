#!/usr/bin/env bash
# One GPU session's measurements (issue 16), for the device machine: install this checkout
# into the image's torch/Triton, run the kernel suite and the model-level run with time budgets
# that leave room for a rerun, copy the JSON to $OUT (the device tool brings it back).
#   bash bench/gpu_run.sh [suite-budget-s] [model-budget-s] [tune-budget-s (0: no tile search)]
set -uo pipefail
cd "$(dirname "$0")/.."
SUITE_S="${1:-240}"
MODEL_S="${2:-200}"
TUNE_S="${3:-0}"
export TRITON_DEFAULT_FP_FUSION=1
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
python bench/gpu_suite.py --budget-s "$SUITE_S" || rc=$?
python bench/gpu_model.py --budget-s "$MODEL_S" || rc=$?
if [ "$TUNE_S" != "0" ]; then
    GLM5_TUNING_CACHE=bench/results/tuning_cache python -m glm5.cli tune --backend cuda \
        --budget-s "$TUNE_S" --table bench/results/cuda_tuning_candidate.json \
        --out "bench/results/gpu_tune_$(date +%Y%m%d_%H%M%S).json" || rc=$?
fi
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && cp -v bench/results/gpu_suite_*.json bench/results/gpu_model_*.json \
        bench/results/gpu_tune_*.json bench/results/cuda_tuning_candidate.json "$OUT"/ 2>/dev/null
    [ -d bench/results/tuning_cache ] && cp -r bench/results/tuning_cache "$OUT"/
fi
exit $rc
