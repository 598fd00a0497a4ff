"""Long prompts within the model's limit, numbers too large for the pool, and running out of
memory: a correct run or one line, never a traceback."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, hf_model, invoke, record_logits
from pagedcli.backends import torch as torch_backend
from pagedcli.core.options import SamplingParams


def test_a_long_prefill_runs_in_chunks_with_the_same_results(tiny, make_engine, monkeypatch):
    """A budget so small that a 200-token prompt's attention runs in chunks of 5 query rows: no
    index tensor of the step is as large as [Lq, Lk], and the logits are transformers'."""
    monkeypatch.setattr(torch_backend, "ATTENTION_CHUNK_ELEMENTS", 200 * 4 * 5)  # Lk x heads x 5 rows
    prompt = [(7 * i) % 200 + 3 for i in range(200)]
    engine = make_engine(tiny, batch=2).engine
    seen = record_logits(engine)
    prepare = engine.runner.model.backend.prepare
    largest = []

    def watching(batch):
        prepare(batch)
        step = engine.runner.model.backend._step  # (the CPU backend's decode steps keep theirs elsewhere)
        largest.append(max((t.numel() for t in step.values() if torch.is_tensor(t)), default=0))

    engine.runner.model.backend.prepare = watching
    seq = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert largest[0] < 200 * 200 // 4, "a step's indices grew with the square of the prompt"  # the mask was 200 x 200
    tokens, ref = hf_greedy(hf_model(tiny), prompt, 4)
    assert seq.output_token_ids == tokens
    for a, b in zip(seen[seq.id], ref):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)


def test_chunked_and_whole_attention_agree_for_a_batch(tiny, make_engine, monkeypatch):
    prompts = [[5 + i % 50 for i in range(60)], [9, 4, 33], [100 + i % 90 for i in range(41)]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    whole = make_engine(tiny, batch=3).engine.run_to_completion(prompts, params)
    monkeypatch.setattr(torch_backend, "ATTENTION_CHUNK_ELEMENTS", 3 * 60 * 4 * 7)  # 7 query rows a chunk
    chunked = make_engine(tiny, batch=3).engine.run_to_completion(prompts, params)
    assert [s.output_token_ids for s in chunked] == [s.output_token_ids for s in whole]


@pytest.mark.parametrize("error, line", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:119] data. DefaultCPUAllocator: not enough memory: you tried to "
                  "allocate 10000000000 bytes. Error code 12 (Cannot allocate memory)"),
     "error: out of cpu memory (it asked for 10000000000 bytes)"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.31 GiB. GPU 0 has a total capacity of 139 GiB"),
     "error: out of GPU memory (it asked for 9.31 GiB)"),
    (MemoryError(), "error: out of cpu memory"),
])
def test_torchs_allocation_failures_are_one_line(stories, monkeypatch, error, line):
    def attend(*_):
        raise error

    monkeypatch.setattr(torch_backend.TorchBackend, "attend", attend)
    code, _, err = invoke("generate", "--model", str(stories), "--max-tokens", "3", "hi")
    assert code == 1 and err.strip().splitlines() == [line + " (use a smaller --cache-size, --batch or prompt)"]


def test_other_runtime_errors_are_not_called_out_of_memory(stories, monkeypatch):
    def attend(*_):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(torch_backend.TorchBackend, "attend", attend)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        invoke("generate", "--model", str(stories), "--max-tokens", "3", "hi")


@pytest.mark.parametrize("args, fragment", [
    (["--cache-size", "1e30"], "--cache-size 1e30: "),
    (["--cache-size", "inf"], "--cache-size 'inf' is not a size"),
    (["--num-blocks", str(10**20)], f"--num-blocks {10**20}: "),
    (["--batch", str(10**30)], f"--batch {10**30}: more slots than"),
])
def test_numbers_too_large_for_the_pool_or_batch(stories, args, fragment):
    code, _, err = invoke("generate", "--model", str(stories), "--max-tokens", "3", *args, "hi")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: " + fragment), err
