#!/usr/bin/env bash
# A/B on a GPU machine: `pagedcli bench` of the working tree against an earlier commit, in one run
# on one machine, alternating, twice each (figures move by a few percent between machines of a
# kind, so only the same run compares).
#
#   tools/ab_bench.sh --prepare REV      # here: the commit's tree into .gpu/base.tar (git-ignored)
#   BATCHES=1,2,64 tools/ab_bench.sh     # there (the device tool carries .gpu/)
#   BATCHES=256 BENCH_ARGS="--gpu-memory-utilization 0.9" tools/ab_bench.sh   # more bench options
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
for _ in 1 2; do
  (cd "$base" && PYTHONPATH=$base bench base)
  PYTHONPATH=$PWD bench new
done
