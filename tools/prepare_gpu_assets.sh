#!/usr/bin/env bash
# Copy what a GPU round reads from ../shared into .gpu/shared (git-ignored; carried by the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${PAGEDCLI_SHARED:-../shared}
mkdir -p .gpu/shared/models .gpu/shared/configs .gpu/shared/data
cp -r "$shared/models/stories260K" .gpu/shared/models/
cp -r "$shared/configs/Llama-3.2-1B-Instruct" .gpu/shared/configs/
cp "$shared/data/tinyshakespeare.txt" "$shared/data/SOURCE.md" .gpu/shared/data/
chmod -R u+w .gpu
du -sh .gpu
