#!/usr/bin/env bash
# One GPU session's measurements (issue 16), for the device machine: install this checkout
# into the image's torch/Triton, run the kernel suite and the model-level run with time budgets
# that leave room for a rerun, the JSON written into $OUT as it is measured (the device tool
# brings $OUT back, also from a run killed at its time limit).
#   bash bench/gpu_run.sh [suite-budget-s] [model-budget-s] [tune-budget-s (0: no tile search)]
# A budget of 0 skips that step: the device tool allows 600 s a command, so a session runs
# `bash bench/gpu_run.sh 240 200` and, with device time left, `bash bench/gpu_run.sh 0 0 240`.
# RESULTS=DIR: where the JSON goes (default $OUT when set, else bench/results).
# GPU_RUN_SMOKE=1: the same steps on the CPU, the kernels through the Triton interpreter at tiny
# shapes, nothing installed (a test of this script: tests/test_bench_gpu_suite.py; no GPU
# numbers).
set -uo pipefail
cd "$(dirname "$0")/.."
SUITE_S="${1:-240}"
MODEL_S="${2:-200}"
TUNE_S="${3:-0}"
RES="${RESULTS:-${OUT:-bench/results}}"
STAMP="$(date +%Y%m%d-%H%M%S)"
export TRITON_DEFAULT_FP_FUSION=1
if [ "${GPU_RUN_SMOKE:-0}" = "1" ]; then
    export TRITON_INTERPRET=1
    SUITE_ARGS=(--device cpu --examples 1)
    MODEL_ARGS=(--device cpu --preset tiny --prefill 16 --hf-max 16 --decode-batches 1
                --decode-prompt 12 --first-steps 1 --decode-steps 2 --profile-len 16
                --fp8-prefill 16)
    TUNE_ARGS=(--emulate --ops rms_norm)
else
    python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
    SUITE_ARGS=()
    MODEL_ARGS=()
    TUNE_ARGS=()
fi
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p "$RES"
rc=0
if [ "$SUITE_S" != "0" ]; then
    python bench/gpu_suite.py --budget-s "$SUITE_S" --out "$RES" "${SUITE_ARGS[@]}" || rc=$?
fi
if [ "$MODEL_S" != "0" ]; then
    python bench/gpu_model.py --budget-s "$MODEL_S" --out "$RES/gpu_model_$STAMP.json" \
        "${MODEL_ARGS[@]}" || rc=$?
fi
if [ "$TUNE_S" != "0" ]; then
    GLM5_TUNING_CACHE="$RES/tuning_cache" python -m glm5.cli tune --backend cuda \
        --budget-s "$TUNE_S" --table "$RES/cuda_tuning_candidate.json" \
        --out "$RES/gpu_tune_$STAMP.json" "${TUNE_ARGS[@]}" || rc=$?
fi
exit $rc
