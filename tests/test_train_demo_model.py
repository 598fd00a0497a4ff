"""tools/train_demo_model.py, a few steps on the slice of tiny Shakespeare in tests/assets: the
folder it writes is one pagedcli loads and runs exactly as transformers does (the built-in demo
model is this script's output on the whole corpus)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from conftest import ASSETS, REPO
from test_oracle import assert_matches_hf

CORPUS = ASSETS / "tinyshakespeare" / "head.txt"


def test_trainer_writes_a_folder_pagedcli_runs_as_transformers_does(tmp_path, make_engine):
    out = tmp_path / "demo"
    # a subprocess: the trainer sets process-wide torch state (seeds, matmul precision)
    run = subprocess.run([sys.executable, str(REPO / "tools" / "train_demo_model.py"), "--data", str(CORPUS),
                          "--out", str(out), "--device", "cpu", "--max-steps", "3", "--batch-size", "2",
                          "--warmup-steps", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 3 and report["corpus"]["sha256"] == hashlib.sha256(CORPUS.read_bytes()).hexdigest()

    loaded = make_engine(out, batch=2)
    tok = loaded.tokenizer
    assert tok.decode(tok.encode("ROMEO:\nWhat, ho!")[1:]) == "ROMEO:\nWhat, ho!"  # BOS first, then a round trip
    assert_matches_hf(loaded, out, [tok.encode(t) for t in ["ROMEO:", "First Citizen:\nWe"]], steps=6)
