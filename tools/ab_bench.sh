#!/usr/bin/env bash
# A/B on a GPU machine: `pagedcli bench` of the working tree against an earlier commit, in one run
# on one machine, alternating, twice each (figures move by a few percent between machines of a
# kind, so only the same run compares).
#
#   tools/ab_bench.sh --prepare REV      # here: the commit's tree into .gpu/base.tar (git-ignored)
#   BATCHES=1,2,64 tools/ab_bench.sh     # there (the device tool carries .gpu/)
#   BATCHES=256 BENCH_ARGS="--gpu-memory-utilization 0.9" tools/ab_bench.sh   # more bench options
#   REPLAY=1 BATCHES=64,256 tools/ab_bench.sh   # each decode step's CUDA graph replayed back to back
#                                               # (tools/tune_decode.py): GPU time alone, without the
#                                               # host's noise, which hides changes of a few percent
set -uo pipefail
if [ "${1:-}" = --prepare ]; then
  mkdir -p .gpu && git archive "${2:?a commit}" -o .gpu/base.tar && echo ".gpu/base.tar: $(git rev-parse --short "$2")"
  exit
fi
base=$(mktemp -d)
tar xf .gpu/base.tar -C "$base"
bench() {  # $1: label; runs in the current folder's pagedcli
  timeout 180 python3 -m pagedcli bench --model random:llama-3.2-1b --batch "${BATCHES:-1,2,64}" --input-len 128 \
    --output-len 256 ${BENCH_ARGS:-} --json 2>/dev/null | python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    print(f\"$1 batch {r['batch']}: {r['decode_tokens_per_s']:.0f} tok/s, {r['decode_step_ms']:.4f} ms, {r['roofline_fraction']:.3f} of roofline\")"
}
replay() {  # $1: label; the current folder's tools/tune_decode.py, one batch at a time
  local batches=${BATCHES:-1,2,64}
  for b in ${batches//,/ }; do
    timeout 150 python3 tools/tune_decode.py --only "gemv (default)" --variant-batch "$b" --no-tables \
      --profile-variants 2>/dev/null | grep '^{' | python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    print(f\"$1 batch $b: graph replay {r['graph_replay_ms']:.4f} ms ({r['decode_tokens_per_s']:.0f} tok/s in its bench)\")"
  done
}
run=bench
[ -n "${REPLAY:-}" ] && run=replay
for _ in 1 2; do
  (cd "$base" && PYTHONPATH=$base $run base)
  PYTHONPATH=$PWD $run new
done
