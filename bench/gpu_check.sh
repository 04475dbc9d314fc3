#!/usr/bin/env bash
# The GPU checks of loom in one run, on a machine with an NVIDIA GPU and no network:
#
#   here:   bash bench/gpu_wheels.sh   # .whl/: what `loom serve` needs beyond the image's
#                                      # torch/triton/transformers, and the supervisor for 3.12
#   there:  bash bench/gpu_check.sh    # with .whl carried; step time limits add up to 7.5 minutes
#
# 1. the CUDA platform's tests on the GPU (kernels against torch, the worker's graphs);
# 2. bench/gpu_kernels.py (achieved GB/s and TFLOP/s against the device's peak and torch);
# 3. `loom serve` with bench/serve_throughput.py: an OPT-125m-shaped model (also against
#    loom.LLM offline) and a SmolLM2-135M-shaped one (random weights: the 98 MB GGUF of the
#    default model cannot travel), bf16, 256 prompts x (128 in, 128 out) at once.
# Logs go to $OUT (or /tmp/gpu_check); a summary table ends the output.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/loom-site
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "cannot install .whl"; exit 1; }
fi
# loom from this source tree, ahead of anything installed
export PYTHONPATH="$PWD/packages/plugin-api/src:$PWD/packages/engine-core/src:$PWD/packages/platform-cuda/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 LOOM_CACHE_DIR=/tmp/loom-cache

rows=()
run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, keep a summary row
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  local key
  key=$(grep -E "passed|failed|serve:|offline loom|TPOT|headline|decode.*bs=64" "$OUT/$name.log" | tail -n 3 | tr '\n' ' ')
  rows+=("| $name | $([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)") | $((SECONDS - start)) s | ${key:0:300} |")
}

nvidia-smi -L | tee "$OUT/env.log"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/env.log"
run platform-tests 120 "$PY" -m pytest -q -p no:cacheprovider packages/platform-cuda/tests
run kernels-bench 100 "$PY" bench/gpu_kernels.py
run serve-opt-125m 130 "$PY" bench/serve_throughput.py --model opt-125m --dtype bfloat16 \
  --num-prompts 256 --input-len 128 --output-len 128 --compare-offline
run serve-smollm2-shape 100 "$PY" bench/serve_throughput.py --model smollm2-shape --dtype bfloat16 \
  --num-prompts 256 --input-len 128 --output-len 128

echo
echo "| check | result | time | figures |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}" | tee "$OUT/summary.md"
