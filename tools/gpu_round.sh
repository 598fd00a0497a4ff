#!/usr/bin/env bash
# One full round on a GPU machine, in one command: install, (optionally) train the built-in
# model, run the GPU tests and the benchmarks. Results land in $OUT.
#
#   tools/prepare_gpu_assets.sh          # here: copy what ../shared adds to tests/assets into .gpu/ (git-ignored)
#   TRAIN=1 tools/gpu_round.sh           # there (the device tool carries .gpu/)
#   TUNE=1 BENCH=0 TESTS="tests/test_cuda_*.py" tools/gpu_round.sh   # kernels, tunables, profile
#   ZOO=1 BENCH=0 TESTS=none tools/gpu_round.sh   # bench every preset at batch 1 and 16 (docs/performance.md's table)
#   ZOO=1 ZOO_PRESETS="qwen3-8b mistral-7b-v0.3" BENCH=0 TESTS=none tools/gpu_round.sh   # only these presets
#   QUANT=1 BENCH=0 TESTS=none tools/gpu_round.sh   # issue 50's figures: int4 against bf16, 1B and 8B shapes
#   BENCH=0 TESTS="tests/test_cuda_quant.py" tools/gpu_round.sh   # the compressed weights' GPU tests
#   BENCH=0 TESTS="tests/test_gpu_tensor_parallel.py" tools/gpu_round.sh   # on 2+ GPUs: -tp 2 on NCCL against -tp 1
#
# The whole GPU suite comes close to 10 minutes on one GPU, most of it the kernels' tests and the
# end-to-end tests against transformers (docs/performance-log.md, "How long the GPU suite takes"): where one call is
# limited to 10 minutes, run it in two (BENCH=0 TESTS="tests/test_gpu_end_to_end.py tests/test_cuda_*.py",
# then the other GPU files), and TESTS=none with the bench or TUNE=1 in a third.
set -uo pipefail
OUT=${OUT:-/tmp/pagedcli-out}
mkdir -p "$OUT"
export PAGEDCLI_SHARED=$PWD/.gpu/shared PYTHONUNBUFFERED=1
# the kernels that wait for their GPU tests (backends/cuda_build.py) run here: this round is those tests
export PAGEDCLI_UNVERIFIED_KERNELS=${PAGEDCLI_UNVERIFIED_KERNELS:-1}
log() { echo "=== $* ($(date +%T))"; }

log install
if compgen -G ".gpu/wheels/*.whl" >/dev/null; then  # what the image lacks (tools/prepare_gpu_assets.sh)
  python3 -m pip install -q --no-deps .gpu/wheels/*.whl >"$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"

if [ "${TRAIN:-0}" = 1 ]; then
  [ -f .gpu/shared/data/tinyshakespeare.txt ] || { echo "TRAIN=1 needs .gpu/shared/data/tinyshakespeare.txt (tools/prepare_gpu_assets.sh)"; exit 1; }
  log "train the demo model (background, ${TRAIN_MINUTES:-4} min)"
  (python3 tools/train_demo_model.py --data .gpu/shared/data/tinyshakespeare.txt --out /tmp/demo \
     --minutes "${TRAIN_MINUTES:-4}" >"$OUT/train.log" 2>&1; echo "train exit $?" >>"$OUT/train.log") &
  TRAIN_PID=$!
fi

if [ "${TESTS:-tests}" != none ]; then
  log "GPU tests"
  timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -m gpu -q -rs ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi

if [ -n "${TRAIN_PID:-}" ]; then
  log "wait for training"
  wait "$TRAIN_PID"
  tail -5 "$OUT/train.log"
  tar czf "$OUT/demo.tgz" -C /tmp demo
fi

if [ "${TUNE:-0}" = 1 ]; then
  log "batch-1 decode under the backend's tunables, then a kernel profile"
  eval "tune_args=(${TUNE_ARGS:-})"  # quoted words stay whole: TUNE_ARGS='--only "gemv (default)"'
  timeout "${TUNE_TIMEOUT:-240}" python3 tools/tune_decode.py "${tune_args[@]}" 2>&1 | tee "$OUT/tune.txt"
fi

if [ "${ZOO:-0}" = 1 ]; then
  log "bench every preset (random weights of public checkpoints' shapes), batch 1 and 16, 128 in / 128 out"
  for preset in ${ZOO_PRESETS:-$(python3 -c "from pagedcli.model.presets import RANDOM_PRESETS; print(' '.join(RANDOM_PRESETS))")}; do
    timeout 120 pagedcli bench --model "random:$preset" --batch 1,16 --input-len 128 --output-len 128 --json \
      >>"$OUT/zoo.jsonl" 2>>"$OUT/zoo.err" || echo "$preset: exit $?" | tee -a "$OUT/zoo.err"
  done
  python3 tools/zoo_table.py "$OUT/zoo.jsonl" | tee "$OUT/zoo.md"
fi

if [ "${QUANT:-0}" = 1 ]; then
  # compressed weights (issue 50): random weights of Llama-3.2-1B and Llama-3.1-8B shapes, 4-bit group 128
  # (`--quantization int4`) beside bf16 on the same card, batch 1 and 64, 128-token prompts, 256 new tokens
  log "bench --quantization int4 against bf16, random Llama-3.2-1B and Llama-3.1-8B, batch 1 and 64, 128 in / 256 out"
  for preset in ${QUANT_PRESETS:-llama-3.2-1b llama-3.1-8b}; do
    for quant in none int4; do
      timeout "${QUANT_TIMEOUT:-240}" pagedcli bench --model "random:$preset" --quantization "$quant" \
        --batch "${QUANT_BATCHES:-1,64}" --input-len 128 --output-len 256 --json \
        >>"$OUT/quant.jsonl" 2>>"$OUT/quant.err" || echo "$preset $quant: exit $?" | tee -a "$OUT/quant.err"
    done
  done
  cat "$OUT/quant.jsonl"; tail -5 "$OUT/quant.err"
fi

if [ "${BENCH:-1}" = 1 ]; then
  log "bench: random Llama-3.2-1B shapes, 128-token prompts, 256 new tokens"
  timeout 240 pagedcli bench --model random:llama-3.2-1b --batch "${BATCHES:-1,64,256}" --input-len 128 \
    --output-len 256 --json >"$OUT/bench.jsonl" 2>"$OUT/bench.err"
  cat "$OUT/bench.jsonl"; tail -3 "$OUT/bench.err"
  log "bench --kernel"
  timeout 120 pagedcli bench --model random:llama-3.2-1b --kernel 2>&1 | tee "$OUT/kernel.txt"
  log "bench --compare hf (batch 1)"
  timeout 120 pagedcli bench --model random:llama-3.2-1b --batch 1 --output-len 64 --compare hf 2>&1 | tee "$OUT/compare.txt"
fi
log done
