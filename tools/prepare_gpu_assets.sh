#!/usr/bin/env bash
# Copy what a GPU round reads from ../shared (or $PAGEDCLI_SHARED) into .gpu/shared (git-ignored;
# carried by the device tool). stories260K needs no copy: it is in tests/assets, which travels with
# the working tree. What is missing here is left out with a note: the tests that need it skip, and
# TRAIN=1 needs data/tinyshakespeare.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${PAGEDCLI_SHARED:-../shared}
mkdir -p .gpu/shared
for asset in configs/Llama-3.2-1B-Instruct data/tinyshakespeare.txt data/SOURCE.md; do
  if [ -e "$shared/$asset" ]; then
    mkdir -p ".gpu/shared/$(dirname "$asset")"
    cp -r "$shared/$asset" ".gpu/shared/$asset"
  else
    echo "prepare_gpu_assets: $shared/$asset not found, left out" >&2
  fi
done
# the device's image lacks some of our dependencies (gguf: its import is at model/gguf_file.py's top,
# so every engine test needs it) and reaches no index: their wheels travel in .gpu/wheels
mkdir -p .gpu/wheels
python3 -m pip download -q --no-deps -d .gpu/wheels gguf || echo "prepare_gpu_assets: gguf's wheel not downloaded" >&2
chmod -R u+w .gpu
du -sh .gpu
