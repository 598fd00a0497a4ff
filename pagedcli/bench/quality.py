"""`pagedcli bench --quality`: what FP8, int4 and int8 cost in quality, measured against the model dtype.

For the model in its dtype and for each fp8 option (K/V, weights, both; model/fp8.py) and the int4
and int8 weights quantized at load (model/quant.py):
- perplexity on held-out text: the text's tokens in windows of WINDOW_TOKENS, each window one
  prefill through the paged cache (its K/V written to the pool and read back, so an fp8 pool's
  rounding counts), every position's next-token loss but the window's first;
- greedy agreement with the model dtype: for prompts cut from the same text (PROMPT_TOKENS each),
  the share of the first `num_tokens` greedy tokens that equal the model dtype's, up to the first
  that differs (after it the two continue different texts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pagedcli.core.batch import StepBatch
from pagedcli.core.errors import UsageError, plural
from pagedcli.core.options import EngineOptions, SamplingParams
from pagedcli.engine.build import build_engine, load_model
from pagedcli.model.files import read_given_text
from pagedcli.model.hub_quant import packed_scheme
from pagedcli.model.source import DEMO_FOLDER, ModelSource, resolve_model

WINDOW_TOKENS = 256  # tokens a perplexity window holds (the demo model's training windows)
PROMPT_TOKENS = 16  # tokens a greedy-agreement prompt holds
DEFAULT_PROMPTS = 8  # greedy-agreement prompts when --num-prompts is not given
HELDOUT_FILE = "heldout.txt"  # the built-in model's held-out slice, in its folder (data/demo/README.md)

# (name, kv_cache_dtype, quantization); the first is the baseline the others are held against
VARIANTS = (("model dtype", "auto", "none"), ("fp8 KV", "fp8", "none"), ("fp8 weights", "auto", "fp8"),
            ("fp8 weights + KV", "fp8", "fp8"), ("int8 weights", "auto", "int8"), ("int4 weights", "auto", "int4"))
# beside a baseline in a 16-bit dtype, float32 shows how far that dtype itself is from exact
SCALE_VARIANT = "float32, for scale"


@dataclass
class QualityRow:
    variant: str
    dtype: str  # the model dtype of this row
    kv_cache_dtype: str
    quantization: str
    perplexity: float
    perplexity_change: float  # relative to the baseline: 0.01 is 1% higher
    greedy_match: float  # mean share of the first N greedy tokens equal to the baseline's, up to the first difference
    identical_prompts: int  # prompts whose first N greedy tokens are all the baseline's
    num_prompts: int
    weight_bytes: int


def quality_text(path: Path | None, source: ModelSource) -> str:
    """The held-out text: the file given, or the built-in model's held-out slice."""
    if path is None:
        if source.folder is None or source.folder.resolve() != DEMO_FOLDER.resolve():
            raise UsageError(f"--quality needs held-out text for {source.name}", "give it with --quality-text FILE")
        path = DEMO_FOLDER / HELDOUT_FILE
    return read_given_text(path, f"--quality-text {path}", "give a text file")


def compressed_as(source: ModelSource) -> str | None:
    """What `source`'s weights are compressed as where it ships them so (a GGUF file, a 4-bit Hub
    checkpoint), which `quantization` refuses to quantize again; None for float (or fp8) weights."""
    if source.gguf is not None:
        return "a GGUF file's quant types"
    if not source.random and (scheme := packed_scheme(source.config)) is not None:
        return f"{scheme.method} 4-bit"
    return None


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    """Consecutive windows of `window` tokens (the last may be shorter; one of a token has no loss)."""
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]


def perplexity(engine, windows: list[list[int]]) -> float:
    """exp(mean next-token loss) over every window position but the first, each window one prefill
    into slot 0 of `engine`'s cache, its blocks released after."""
    cache, llama = engine.cache, engine.runner.model
    total, count = 0.0, 0
    for window in windows:
        cache.grow(0, len(window))
        cache.sync_device_table()
        batch = StepBatch.build(True, [0], [window], [0], cache.device)
        batch.last_index = torch.arange(len(window), device=cache.device)  # logits at every position
        logits, _ = llama.forward(batch)
        cache.release(0)
        target = torch.tensor(window[1:], device=logits.device)
        total += F.cross_entropy(logits[:-1].float(), target, reduction="sum").item()
        count += len(window) - 1
    return math.exp(total / count)


def greedy_tokens(engine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    seqs = engine.run_to_completion(prompts, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    return [s.output_token_ids for s in seqs]


def agreement(base: list[list[int]], other: list[list[int]], num_tokens: int) -> tuple[float, int]:
    """(mean share of the first tokens equal before the first difference, prompts all equal)."""
    shares = []
    for a, b in zip(base, other):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / num_tokens)
    return sum(shares) / len(shares), sum(s == 1.0 for s in shares)


def check_prompts(prompts: list[list[int]], asked: int, num_tokens: int, max_model_len: int, window: int,
                  notice) -> None:
    """Refuse greedy lengths the model cannot hold; say so when the text gives fewer prompts than asked."""
    longest = max(len(p) for p in prompts)
    if longest + num_tokens > max_model_len:
        raise UsageError(f"--output-len {num_tokens}: the agreement prompts ({plural(longest, 'token')}) and "
                         f"their greedy tokens would be {longest + num_tokens:,}, more than the maximum length "
                         f"of {max_model_len:,}", f"give --output-len {max_model_len - longest} or less")
    if len(prompts) < asked:
        notice(f"the held-out text gives {plural(len(prompts), 'prompt')} (one a {window}-token window) "
               f"of the {asked:,} asked for; measuring those")


def measure_quality(opts: EngineOptions, text_path: Path | None, num_prompts: int, num_tokens: int,
                    notice=lambda _: None, progress=lambda _: None) -> tuple[list[QualityRow], SimpleNamespace]:
    """The table's rows, one per VARIANTS entry, each on the model loaded with its options; and
    the baseline's source, device and dtype (for the table's title)."""
    source = resolve_model(opts.model)
    text = quality_text(text_path, source)  # refused before anything loads
    rows, base_ppl, base_tokens, base = [], None, None, None
    stored = compressed_as(source)  # (weights a file ships compressed take no `quantization`: only the KV's variants)
    variants = [(name, kv, quant, opts.dtype) for name, kv, quant in VARIANTS if quant == "none" or stored is None]
    if stored is not None:
        notice(f"the weights are {stored} as the model ships them: measuring the KV cache's variants alone")
    for name, kv, quant, dtype in variants:
        progress(name)
        variant = replace(opts, kv_cache_dtype=kv, quantization=quant, dtype=dtype, batch=max(1, num_prompts),
                          prefix_caching=False)
        model = load_model(variant, notice)
        if base is None and model.dtype != torch.float32:
            variants.append((SCALE_VARIANT, "auto", "none", "float32"))
        if model.tokenizer is None:
            raise UsageError(f"--quality needs a tokenizer, and {model.source.name} has none",
                             "use a model folder with tokenizer.json")
        engine = build_engine(model, variant, notice)
        ids = model.tokenizer.encode(text)
        window = min(WINDOW_TOKENS, engine.cache.max_model_len)
        windows = windows_of(ids, window)
        if not windows:
            raise UsageError(f"the held-out text is {plural(len(ids), 'token')}: too short to measure")
        prompts = [w[:PROMPT_TOKENS] for w in windows[:num_prompts]]
        if base_ppl is None:
            check_prompts(prompts, num_prompts, num_tokens, engine.cache.max_model_len, window, notice)
        ppl = perplexity(engine, windows)
        tokens = greedy_tokens(engine, prompts, num_tokens)
        if base_ppl is None:
            base_ppl, base_tokens = ppl, tokens
        match, identical = agreement(base_tokens, tokens, num_tokens)
        rows.append(QualityRow(name, str(model.dtype).removeprefix("torch."), kv, quant, ppl, ppl / base_ppl - 1,
                               match, identical, len(prompts), model.weights.nbytes))
        if base is None:  # what the table's title needs; the weights go (each variant loads its own)
            base = SimpleNamespace(source=model.source, device=model.device, dtype=model.dtype)
        del engine, model
    return rows, base
