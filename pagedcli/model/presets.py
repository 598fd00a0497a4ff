"""The shapes of public checkpoints shipped with pagedcli (data/presets/<name>.json, each one
checkpoint's config.json), for `--model random:<name>`. Kept free of torch: the CLI's help lists them."""

from __future__ import annotations

from pathlib import Path

PRESETS_DIR = Path(__file__).parent.parent / "data" / "presets"
RANDOM_PRESETS: dict[str, Path] = {p.stem: p for p in sorted(PRESETS_DIR.glob("*.json"))}
