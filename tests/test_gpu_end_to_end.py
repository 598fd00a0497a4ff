"""End to end on the GPU, against transformers: the CUDA path (our kernels, CUDA graphs) must
generate what LlamaForCausalLM generates. Skipped without CUDA and CuPy."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import check_block_accounting, hf_greedy, hf_model
from pagedcli.engine.build import build_engine, load_model
from pagedcli.core.options import EngineOptions
from pagedcli.core.options import SamplingParams


def _cuda_ready() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0]


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA and CuPy")]

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball. She wanted to play with it, but it was too high")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("batch", [3, 2, 1])  # decode through cuBLAS, and gemv.cu's buckets 2 and 1
def test_stories260k_on_cuda_matches_transformers(stories, eager, batch):
    # a pool of 40 blocks a layer: check_block_accounting walks the free list at every step, and the
    # default 2 GiB holds half a million of stories260K's 4 KiB blocks
    opts = EngineOptions(model=str(stories), device="cuda", dtype="float32", batch=batch, eager=eager, shuffle_blocks=7,
                         num_blocks=5 * 40)
    model = load_model(opts)
    engine = build_engine(model, opts)
    tok = model.tokenizer
    prompts = [[1]] + [tok.encode(t) for t in ["Once upon a time", "Tom and his dog", "The sun was hot and the bird"]]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert tok.decode(seqs[0].output_token_ids) == STORY
    ref = hf_model(stories, torch.float32, "cuda")
    for seq, prompt in zip(seqs, prompts):
        assert seq.output_token_ids == hf_greedy(ref, prompt, 60, "cuda")[0]
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks


# decode through cuBLAS, and gemv.cu's bucket 1; then batch 4 with one decode CTA per (sequence, kv
# head), as large batches run: attention on tensor cores (paged_decode_mma.cu)
@pytest.mark.parametrize("batch, one_cta", [(4, False), (1, False), (4, True)],
                         ids=["4", "1", "4-decode-on-tensor-cores"])
def test_llama_1b_shapes_bf16_match_transformers_or_diverge_at_a_near_tie(batch, one_cta, monkeypatch):
    """Random weights of the real Llama-3.2-1B shapes in bf16: greedy tokens identical for 32 steps,
    or the first divergence is a near-tie in transformers' own logits (bf16 rounds differently in
    different but equally valid orders of summation)."""
    if one_cta:
        monkeypatch.setattr("pagedcli.backends.cuda_launch.SPLIT_CTAS_PER_SM", 0)

    opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", batch=batch, shuffle_blocks=3,
                         cache_size="1GiB")
    model = load_model(opts)
    # N(0, 0.02) weights give near-uniform logits; scale the output head so the argmax is meaningful
    model.weights.lm_head.mul_(8)
    engine = build_engine(model, opts)
    backend = engine.runner.model.backend
    assert (backend.shapes.num_splits(batch) == 1 and backend.decode_mma_shared > 0) == one_cta
    rng = random.Random(0)
    prompts = [[rng.randrange(128000) for _ in range(n)] for n in (5, 16, 17, 100)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    print(same_as_transformers_until_a_near_tie(model, seqs, prompts, 32))


def same_as_transformers_until_a_near_tie(model, seqs, prompts, steps: int) -> list:
    """Each sequence's greedy tokens against transformers' generate on the same weights: identical,
    or the first divergence is a near-tie in transformers' own logits (bf16 rounds differently in
    different but equally valid orders of summation). Returns what happened to each."""
    from pagedcli.bench.hf import hf_model as hf_from_ours

    hf = hf_from_ours(model)
    report = []
    for seq, prompt in zip(seqs, prompts):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        ref = out.sequences[0, len(prompt):].tolist()
        ours = seq.output_token_ids
        if ours == ref:
            report.append((len(prompt), "identical"))
            continue
        i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
        logits = out.logits[i][0].float()
        gap = (logits[ref[i]] - logits[ours[i]]).item()
        scale = logits.abs().max().item()
        report.append((len(prompt), f"diverges at step {i}: gap {gap:.4f} of max |logit| {scale:.2f}"))
        assert gap <= 0.02 * scale, f"step {i}: not a near-tie ({report})"
    return report


def test_llama_1b_long_prompts_through_cudnn_match_transformers(monkeypatch):
    """On sm_90+ a whole prompt of CUDNN_MIN_TOKENS or more takes cuDNN's attention
    (cudnn_prefill.py), beside paged_prefill.cu for the rest of its step: a prompt of
    CUDNN_MIN_TOKENS (cuDNN) and prompts of 300 and 3,000 (ours, the second just under the
    floor) in one step, then a prompt of CUDNN_MIN_TOKENS + 500 in two chunks (its first through
    cuDNN, the second through ours over the first's blocks). Greedy tokens as transformers', up to
    a near-tie, and cuDNN took exactly the whole prompts it should."""
    from pagedcli.backends import cuda as cuda_backend
    from pagedcli.backends.cudnn_prefill import CUDNN_MIN_TOKENS

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN's prefill path is taken on sm_90+")
    served = []
    attend = cuda_backend.attend_whole_prompt
    monkeypatch.setattr(cuda_backend, "attend_whole_prompt",
                        lambda cache, layer, q, slot: served.append(q.shape[0]) or attend(cache, layer, q, slot))
    first_chunk = CUDNN_MIN_TOKENS + 100
    model = None
    for budget, lengths in ((8192, (CUDNN_MIN_TOKENS, 300, 3000)), (first_chunk, (CUDNN_MIN_TOKENS + 500,))):
        opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", batch=len(lengths),
                             shuffle_blocks=3, cache_size="1GiB", max_num_batched_tokens=budget, prefix_caching=False)
        if model is None:
            model = load_model(opts)
            model.weights.lm_head.mul_(8)  # (as above: a meaningful argmax)
        engine = build_engine(model, opts)
        assert engine.runner.model.backend.cudnn_prefill, engine.runner.model.backend.cudnn_prefill_missing
        rng = random.Random(budget)
        prompts = [[rng.randrange(128000) for _ in range(n)] for n in lengths]
        served.clear()
        seqs = [engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
        while engine.has_unfinished:
            engine.step()
        whole = [n for n in lengths if n >= CUDNN_MIN_TOKENS] if budget == 8192 else [first_chunk]
        assert sorted(served) == sorted(whole * model.source.config.num_layers)
        print(budget, same_as_transformers_until_a_near_tie(model, seqs, prompts, 16))
        check_block_accounting(engine)


def test_llama_1b_short_chunks_after_long_prefixes_split_their_keys_and_match_transformers(monkeypatch):
    """A 6,000-token prompt in 512-token chunks beside a decoding sequence (prefill graphs), then
    the same prompt and 40 tokens more (a prefix-cache hit: a 40-token chunk after 6,000 cached, as
    a chat's next turn): the late chunks' keys are split (paged_prefill.cu's parts) in the graphed
    steps, and the greedy tokens are transformers', up to a near-tie."""
    from pagedcli.engine import prefill_graphs

    replay_parts = []  # each graphed step's most parts a tile
    tile_lists = prefill_graphs.prefill_tile_lists

    def recorded(*args, **kwargs):
        lists = tile_lists(*args, **kwargs)
        replay_parts.append(max(lists.parts, default=1))
        return lists

    monkeypatch.setattr(prefill_graphs, "prefill_tile_lists", recorded)
    opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", batch=2, shuffle_blocks=3,
                         cache_size="1GiB", chunked_prefill=True, max_num_batched_tokens=512)
    model = load_model(opts)
    model.weights.lm_head.mul_(8)  # (as above: a meaningful argmax)
    engine = build_engine(model, opts)
    assert engine.runner.model.backend.prefill_split_tiles > 0
    rng = random.Random(6)
    long = [rng.randrange(128000) for _ in range(6000)]
    prompts = [[rng.randrange(128000) for _ in range(20)], long, long + [rng.randrange(128000) for _ in range(40)]]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts[:2]]
    while engine.has_unfinished:
        engine.step()
    seqs.append(engine.add_request(prompts[2], SamplingParams(max_tokens=16, ignore_eos=True)))
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.cached_prompt_tokens >= 5984, "the second long prompt hit the prefix cache"
    assert max(replay_parts, default=1) > 1, f"no graphed step split its keys ({replay_parts})"
    print(same_as_transformers_until_a_near_tie(model, seqs, prompts, 16), replay_parts)
    check_block_accounting(engine)


@pytest.mark.parametrize("batch", [1, 2, 5, 64])  # gemv.cu's buckets 1 and 2; cuBLAS, split-KV; tensor cores
def test_programmatic_launch_changes_no_logit(batch, monkeypatch):
    """On sm_90+ each kernel of ours may start before the previous one has finished, and waits for
    it inside (cuda_launch.Launcher, kernels/common.cuh). The Llama-3.2-1B shapes in bf16, prompts of
    1 to 300 tokens (the prefill kernel too), 40 steps through CUDA graphs: the tokens and the
    log-probabilities of the top 5 are those of the same engine whose launches all wait, to the
    bit. A kernel that read its input before the wait would race and, sooner or later, differ."""
    from pagedcli.backends import cuda as cuda_backend

    import cupy

    from pagedcli.backends.cuda_launch import PROGRAMMATIC_MIN_DRIVER

    if torch.cuda.get_device_capability() < (9, 0) or cupy.cuda.runtime.driverGetVersion() < PROGRAMMATIC_MIN_DRIVER:
        pytest.skip("programmatic dependent launch needs sm_90 and a CUDA 12.3 driver or newer")
    opts = EngineOptions(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", batch=batch, shuffle_blocks=3,
                         cache_size="1GiB")
    model = load_model(opts)
    model.weights.lm_head.mul_(8)
    rng = random.Random(batch)
    prompts = [[rng.randrange(128000) for _ in range(rng.choice([1, 17, 64, 300]))] for _ in range(batch)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=5)
    runs = []
    for programmatic in (True, False):
        monkeypatch.setattr(cuda_backend, "PROGRAMMATIC_LAUNCH", programmatic)
        engine = build_engine(model, opts)
        assert engine.runner.model.backend.launch.programmatic == programmatic
        seqs = engine.run_to_completion(prompts, params)
        runs.append([(s.output_token_ids, [(t.logprob, t.top) for t in s.logprobs]) for s in seqs])
        del engine
    assert runs[0] == runs[1]


def test_cuda_backend_equals_torch_backend_on_gpu(stories):
    """Same engine, same GPU, only the backend differs (torch reference vs our kernels)."""
    from pagedcli.backends import TorchBackend

    opts = EngineOptions(model=str(stories), device="cuda", dtype="float32", batch=2, shuffle_blocks=5)
    model = load_model(opts)
    prompts = [[1], [1, 403, 407, 261, 378]]
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    ours = build_engine(model, opts)
    reference = build_engine(model, EngineOptions(**{**opts.__dict__, "eager": True}))
    reference.runner.model.backend = TorchBackend(reference.cache.store, model.source.config)
    a = [s.output_token_ids for s in ours.run_to_completion(prompts, params)]
    b = [s.output_token_ids for s in reference.run_to_completion(prompts, params)]
    assert a == b


def test_parallel_samples_copy_on_write_on_cuda(stories):
    """Shared prompt blocks and the copy of a shared partial block, on the GPU path."""
    opts = EngineOptions(model=str(stories), device="cuda", dtype="float32", batch=4, shuffle_blocks=9,
                         num_blocks=5 * 40)
    model = load_model(opts)
    prompt = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267]
    params = [SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=11 + j) for j in range(4)]
    engine = build_engine(model, opts)
    shared = engine.add_parallel(prompt, params)
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.cache.num_copied_blocks > 0
    alone = build_engine(model, EngineOptions(**{**opts.__dict__, "batch": 1, "prefix_caching": False}))
    assert [s.output_token_ids for s in shared] == [alone.run_to_completion([prompt], p)[0].output_token_ids for p in params]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_overlap_on_cuda_changes_no_token(stories, eager):
    """The engine's overlap on the GPU (the next step fed from device memory, pinned staging in
    turns, tokens read back per step): the same answers as without it, with stop tokens seen a
    step late, refills of freed slots and a pool small enough to preempt."""
    opts = EngineOptions(model=str(stories), device="cuda", dtype="float32", batch=4, eager=eager, shuffle_blocks=2,
                         num_blocks=5 * 10)  # stories260K has 5 layers: 10 blocks a layer, 160 tokens
    model = load_model(opts)
    tok = model.tokenizer
    texts = ["Once upon a time", "Tom and his dog", "The sun was hot", "Lily had a red", "A big bear", "Sam saw"]
    prompts = [tok.encode(t) for t in texts]
    runs = []
    for overlap in (False, True):
        engine = build_engine(model, EngineOptions(**{**opts.__dict__, "overlap": overlap}))
        assert engine.overlap == overlap
        engine.scheduler.stop_ids |= {tok.encode(" the")[-1]}  # frequent: answers stop at different steps
        seqs = [engine.add_request(p, SamplingParams(max_tokens=48 + 7 * i)) for i, p in enumerate(prompts)]
        while engine.has_unfinished:
            engine.step()
            check_block_accounting(engine)
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        runs.append(([(s.output_token_ids, s.finish_reason) for s in seqs], engine))
    (plain, _), (overlapped, engine) = runs
    assert overlapped == plain
    assert {"stop", "length"} <= {reason for _, reason in plain}
    assert engine.scheduler.num_preemptions > 0 and engine.num_launched_ahead > 0


@pytest.mark.parametrize("budget", [7, 40])
def test_chunked_prefill_on_cuda_changes_no_token(stories, budget):
    """Steps that carry decode tokens beside prompt chunks (eager, through the backend's prefill
    attention), pure decode steps in CUDA graphs with the overlap, a pool small enough to preempt:
    the same answers as without chunking."""
    opts = EngineOptions(model=str(stories), device="cuda", dtype="float32", batch=3, shuffle_blocks=4,
                         num_blocks=5 * 8)
    model = load_model(opts)
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in ["Once upon a time, in a big forest, there lived a", "Tom and his dog",
                                        "The sun was hot and the bird sang a song to the", "Sam saw"]]
    runs = []
    for chunked in (False, True):
        engine = build_engine(model, EngineOptions(**{**opts.__dict__, "chunked_prefill": chunked,
                                                      "max_num_batched_tokens": budget if chunked else None}))
        seqs = [engine.add_request(p, SamplingParams(max_tokens=40 + 5 * i, ignore_eos=True))
                for i, p in enumerate(prompts)]
        partial = 0
        while engine.has_unfinished:
            partial += len(engine.step().prefilling)
            check_block_accounting(engine)
        assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
        runs.append(([s.output_token_ids for s in seqs], partial))
    (plain, _), (chunked, partial) = runs
    assert partial > 0, "no step carried a prompt chunk short of its prompt"
    assert chunked == plain


def test_prefill_steps_from_graphs_match_eager_ones(stories, monkeypatch):
    """Prompt chunks beside decoding sequences, replayed from the prefill graphs (inputs padded to
    the token bucket, padding tiles and rows): each step's logits are the eager forward's of the
    same step, to bf16's rounding (a padded GEMM may sum in another order; float32 has no prefill
    kernel, so no graphs), the graphs served every such step, and every block comes back."""
    from pagedcli.core.batch import StepBatch
    from pagedcli.backends.cuda_prefill_graphs import PrefillGraphs

    pairs = []
    replay = PrefillGraphs.replay

    def eager_then_graph(self, slots, token_ids, num_cached, samples):
        batch = StepBatch.build(True, slots, token_ids, num_cached, torch.device("cuda"), samples)
        eager = self.model.forward(batch)[0].clone()
        logits, greedy = replay(self, slots, token_ids, num_cached, samples)
        pairs.append((eager, logits.clone()))
        return logits, greedy

    monkeypatch.setattr(PrefillGraphs, "replay", eager_then_graph)
    opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", batch=3, shuffle_blocks=4,
                         chunked_prefill=True, max_num_batched_tokens=24)
    model = load_model(opts)
    tok = model.tokenizer
    engine = build_engine(model, opts)
    assert engine.runner.prefill_graphs is not None
    for i, text in enumerate(["Once upon a time, in a big forest, there lived a", "Tom and his dog",
                              "The sun was hot and the bird sang a song to the", "Sam saw"]):
        engine.add_request(tok.encode(text), SamplingParams(max_tokens=30 + 5 * i, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    assert len(pairs) >= 3 and len(engine.runner.prefill_graphs.captured) >= 2  # (three prefill-kind steps, 24 tokens each at most)
    for eager, graph in pairs:
        assert eager.shape == graph.shape
        assert (eager - graph).abs().max().item() <= 0.03 * eager.abs().max().item()


def test_serve_captures_every_graph_before_its_first_request(stories, capsys):
    """The server's engine (commands/serve.py's load_model) has every decode and prefill graph
    captured before it answers: a burst of requests must not stall on a capture per new batch size."""
    from pagedcli.commands.serve import capture_graphs

    opts = EngineOptions(model=str(stories), device="cuda", dtype="bfloat16", batch=20, num_blocks=400,
                         chunked_prefill=True, max_num_batched_tokens=300)
    engine = build_engine(load_model(opts), opts)
    runner = engine.runner
    assert not runner.graphs.captured and not runner.prefill_graphs.captured
    capture_graphs(runner)
    assert sorted(runner.graphs.captured) == runner.graphs.buckets == [1, 2, 4, 8, 16, 20]
    prefill = runner.prefill_graphs
    assert sorted(prefill.captured) == prefill.buckets and prefill.buckets[-1] == 300
    num_prefill = len(runner.prefill_graphs.buckets)
    assert f"captured {6 + num_prefill} CUDA graphs (6 decode and {num_prefill} prefill)" in capsys.readouterr().err
    done = engine.run_to_completion([[1, 403, 407], [1, 261]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert all(len(s.output_token_ids) == 5 for s in done)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
