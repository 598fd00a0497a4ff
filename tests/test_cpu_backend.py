"""The CPU backend (backends/cpu.py) against the torch reference it shortens: the same greedy tokens
and close logits, step by step, on the demo model and on random Llama, Qwen2, Qwen3 and
Mistral-with-a-window checkpoints, through prefix caching, chunked prefill and preemption; keys a
sequence does not own never reach it; and --threads."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_checkpoint
from helpers import invoke

from pagedcli.backends import TorchBackend
from pagedcli.backends.cpu import CpuBackend, DecodePlan
from pagedcli.backends import cpu_kernels
from pagedcli.core.batch import StepBatch
from pagedcli.core.errors import UsageError
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.model.loader import DEFAULT_THREADS, SMALL_MODEL_BYTES, cpu_threads


def recorded_run(loaded, prompts, max_tokens=24, reference=False):
    """Each prompt's greedy tokens, and every step's logits (decode steps and prefill steps alike),
    with the engine's backend or the torch reference in its place."""
    engine = loaded.engine
    model = engine.runner.model
    if reference:
        model.backend = TorchBackend(engine.cache.store, model.config)
    assert isinstance(model.backend, TorchBackend if reference else CpuBackend)
    steps, forward = [], model.forward

    def record(batch):
        logits, greedy = forward(batch)
        steps.append((batch.is_prefill, logits.clone()))
        return logits, greedy

    model.forward = record
    seqs = engine.run_to_completion(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [s.output_token_ids for s in seqs], steps


def assert_same_as_reference(make_engine, model, prompts, max_tokens=24, **opts):
    fast, fast_steps = recorded_run(make_engine(model, **opts), prompts, max_tokens)
    ref, ref_steps = recorded_run(make_engine(model, **opts), prompts, max_tokens, reference=True)
    assert fast == ref
    assert len(fast_steps) == len(ref_steps) and any(not prefill for prefill, _ in fast_steps)
    close = 0.1 if opts.get("dtype") == "bfloat16" else 1e-4  # bfloat16: a few of its roundings apart
    for (prefill, a), (_, b) in zip(fast_steps, ref_steps):
        torch.testing.assert_close(a, b, rtol=close, atol=close)
    return fast


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("batch", [1, 3])
def test_the_demo_model_decodes_as_the_reference(make_engine, batch):
    """Prompts that end inside a block, on its last token and across several blocks."""
    assert_same_as_reference(make_engine, "demo", prompts_of([5, 16, 40], 1000), batch=batch)


@pytest.mark.parametrize("family, extra", [
    ("llama", {}),
    ("qwen2", {}),  # biases on q, k and v
    ("qwen3", {}),  # RMSNorm over each head of q and k
    ("mistral", {"sliding_window": 11}),  # a window shorter than the prompts, crossed many times
])
def test_random_families_decode_as_the_reference(tmp_path, make_engine, family, extra):
    folder = hf_checkpoint(tmp_path, model_type=family, **extra)
    lengths = [3, 21, 9, 30]
    for opts in (dict(batch=4), dict(batch=1, block_size=8), dict(batch=3, block_size=8, max_num_batched_tokens=5)):
        assert_same_as_reference(make_engine, folder, prompts_of(lengths, 211, seed=1), max_tokens=30, **opts)


def test_prefix_caching_chunked_prefill_and_preemption(tiny, make_engine):
    """Prompts sharing 24 tokens (cache hits), in chunks of 6 beside the decoding rows, in a pool so
    small that sequences are preempted and come back (2 layers: 14 blocks of 8 tokens a layer)."""
    shared = prompts_of([24], 211, seed=3)[0]
    prompts = [shared + [5], shared + [6, 7, 8], prompts_of([13], 211, seed=4)[0], shared[:20]]
    assert_same_as_reference(make_engine, tiny, prompts, max_tokens=40, batch=3, block_size=8,
                             max_num_batched_tokens=6)
    loaded = make_engine(tiny, batch=4, block_size=8, num_blocks=2 * 14)
    recorded_run(loaded, prompts, max_tokens=40)
    assert loaded.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for every sequence"
    assert_same_as_reference(make_engine, tiny, prompts, max_tokens=40, batch=4, block_size=8, num_blocks=2 * 14)


def test_keys_a_sequence_does_not_own_never_reach_it(tiny, make_engine):
    """A pool full of NaN where nothing was written (the tail of each last block, the padding of the
    shorter sequences of a batch): the answers are those of a clean pool, at batch 1 and batch 3."""
    prompts = prompts_of([5, 18, 11], 211, seed=2)
    for batch in (1, 3):
        clean, _ = recorded_run(make_engine(tiny, batch=batch, block_size=8), prompts)
        loaded = make_engine(tiny, batch=batch, block_size=8)
        loaded.engine.cache.store.pool.fill_(float("nan"))
        dirty, _ = recorded_run(loaded, prompts)
        assert dirty == clean


def test_a_decode_plan_reads_each_sequences_own_blocks(tiny, make_engine):
    """The plan's rows and blocks are the block table's: the new token's K row in the block its
    position falls in, and the K/V halves of every block from the first visible key to the last."""
    loaded = make_engine(tiny, batch=2, block_size=8, shuffle_blocks=7)
    engine = loaded.engine
    engine.run_to_completion(prompts_of([9, 2], 211), SamplingParams(max_tokens=1, ignore_eos=True))
    backend = engine.runner.model.backend
    table = engine.cache.store.device_table
    for slot, n in ((0, 10), (1, 3)):  # give both slots the blocks of n tokens, then plan their next token
        blocks = torch.arange(-(-n // 8)) * 7 + slot + 1
        table[slot, :, :len(blocks)] = blocks.int()[None, :]
    batch = StepBatch.build(False, [0, 1], [[1], [2]], [9, 2], torch.device("cpu"))
    plan = DecodePlan.build(backend, batch)
    assert plan.num_blocks == 2 and plan.keys is None
    assert plan.k_rows[:, 0].tolist() == [(int(table[0, layer, 1]) * 2 * 8 + 1) for layer in range(2)]
    assert (plan.v_rows - plan.k_rows).unique().tolist() == [8]
    first = plan.blocks[0].view(2, 2, 2)  # [B, K|V, blocks] of layer 0
    assert first[0, 0].tolist() == [2 * b for b in table[0, 0, :2].tolist()]
    assert first[1, 1, 0] == 2 * table[1, 0, 0] + 1
    assert plan.mask[:, 0, 0].sum(-1).tolist() == [10, 3]


def test_an_fp8_pool_runs_the_reference_throughout(tiny, make_engine):
    loaded = make_engine(tiny, kv_cache_dtype="fp8")
    backend = loaded.engine.runner.model.backend
    assert isinstance(backend, CpuBackend) and not backend.fast
    tokens, _ = recorded_run(loaded, prompts_of([6], 211), max_tokens=4)
    assert len(tokens[0]) == 4


def test_threads_are_the_cores_torch_sees_but_one_for_a_small_model(tiny, make_engine):
    assert cpu_threads(None, SMALL_MODEL_BYTES) == DEFAULT_THREADS
    assert cpu_threads(None, SMALL_MODEL_BYTES - 1) == 1
    assert cpu_threads(3, 1) == 3
    make_engine(tiny, threads=2)
    assert torch.get_num_threads() == 2
    make_engine(tiny)
    assert torch.get_num_threads() == 1
    for bad in (0, 10**9):
        with pytest.raises(UsageError, match=f"`threads` {bad}: needs 1 to 1024"):
            EngineOptions(threads=bad)
    code, _, err = invoke("generate", "--threads", "100000", "hi")
    assert code == 2 and "--threads 100000: needs 1 to 1024" in err and "Traceback" not in err


def test_greedy_tokens_flag_every_row_holding_a_nan_or_an_inf_as_the_reference_does(tiny, make_engine):
    backend = make_engine(tiny).engine.runner.model.backend
    logits = torch.randn(5, 300)
    logits[0, 7], logits[1, 299], logits[2, 0], logits[3, 150] = float("nan"), float("inf"), float("-inf"), 1e30
    reference = TorchBackend.argmax(backend, logits)
    assert backend.argmax(logits).tolist() == reference.tolist()
    assert reference[:3].tolist() == [-1, -1, -1] and reference[3] == 150


def test_float32_linears_run_through_onednn_copies_and_others_as_they_are(tiny, make_engine):
    loaded = make_engine(tiny)
    backend, qkv = loaded.engine.runner.model.backend, loaded.weights.layers[0].qkv
    assert len(backend.onednn) == 2 * 4 + 1  # 2 layers' qkv, o, gate_up, down, and the (tied) LM head
    x = torch.randn(cpu_kernels.MAX_ROWS + 2, qkv.shape[1])  # (fewer rows: our kernels, when built)
    torch.testing.assert_close(backend.linear(x, qkv), x @ qkv.T)
    backend.onednn[id(qkv)] = (qkv, (2 * qkv).to_mkldnn())  # the copy is what it multiplies by
    torch.testing.assert_close(backend.linear(x, qkv), 2 * (x @ qkv.T))
    if cpu_kernels.library() is not None:  # a decode step's few rows read the weight itself, not the copy
        few = x[:cpu_kernels.MAX_ROWS]
        torch.testing.assert_close(backend.linear(few, qkv), few @ qkv.T)
    loaded = make_engine(tiny, dtype="bfloat16")  # a reordered copy, for a decode batch's few rows
    backend, qkv = loaded.engine.runner.model.backend, loaded.weights.layers[0].qkv
    assert len(backend.onednn) == 2 * 4 + 1
    for rows in (1, 8, 40):
        x = torch.randn(rows, qkv.shape[1], dtype=torch.bfloat16)
        torch.testing.assert_close(backend.linear(x, qkv), x @ qkv.T)


def test_bfloat16_decodes_as_the_reference(make_engine):
    assert_same_as_reference(make_engine, "demo", prompts_of([5, 16, 40], 1000), batch=3, dtype="bfloat16")


def test_no_onednn_copies_where_they_would_take_much_of_the_memory(tiny, make_engine, monkeypatch):
    import pagedcli.backends.cpu as cpu

    loaded = make_engine(tiny)
    linear_bytes = sum(w.nbytes for lw in loaded.weights.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down))
    monkeypatch.setattr(cpu, "physical_memory", lambda: 3 * linear_bytes)  # the copies would take over a quarter
    backend = make_engine(tiny).engine.runner.model.backend
    assert not backend.onednn
    tokens, _ = recorded_run(make_engine(tiny), prompts_of([6], 211), max_tokens=3)
    assert len(tokens[0]) == 3


def test_compressed_weights_with_float32_activations_multiply_by_one_onednn_copy():
    """A QuantWeight times float32 activations goes through a oneDNN copy of its dequantized matrix,
    made once and kept on the weight: the product is the dequantized reference's."""
    from pagedcli.backends import cpu
    from pagedcli.model.quant import quantize_int4

    if not cpu.onednn_available():
        pytest.skip("this torch has no oneDNN linear")
    w = quantize_int4(torch.randn(48, 256, generator=torch.Generator().manual_seed(0)), 128)
    x, bias = torch.randn(3, 256), torch.randn(48)
    backend = cpu.CpuBackend.__new__(cpu.CpuBackend)  # (linear reads no cache)
    y = backend.linear(x, w, bias)
    torch.testing.assert_close(y, x @ w.dequantize().T + bias, rtol=1e-5, atol=1e-4)
    copy = w.forms[("onednn", torch.float32)]
    assert backend.linear(x[:1], w).shape == (1, 48) and w.forms[("onednn", torch.float32)] is copy
