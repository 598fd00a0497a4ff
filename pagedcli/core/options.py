"""Every engine and sampling option, declared once: its name, type, default and help.

`EngineOptions` (how an engine is built: the model, the device, the cache, the step budget) and
`SamplingParams` (what one request asks of sampling, with vLLM's names) are the declarations. The
command line's flags (commands/options.py), the engine's builder (engine/build.py) and the server's
request fields (serve/protocol.py) are all made from their fields: a field's help is its flag's
help, its default the flag's default. `option()` declares a field; its `flags` give the command
line's spelling where it is not `--field-name`, `cli=False` keeps it off the command line (set by
code: tests, the server), and for a sampling field `api=True` makes it a request field of the server.

This module imports nothing heavy (the command line reads it before torch is imported); the checks
here are the ones that need no model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The values some options may take, and the bounds of their counts.
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: float8 e4m3 (core/fp8.py)
QUANTIZATIONS = ("none", "fp8", "int4", "int8")  # the linear layers' and LM head's weights (model/fp8.py, quant.py)
MAX_ID = 2**31 - 1  # block ids and slots are int32 (the table, the step's batch): at most this
MAX_THREADS = 1024  # --threads: past this no machine has the cores, and each thread costs a stack
MAX_TENSOR_PARALLEL = 64  # --tensor-parallel-size: ranks, a process each (8 GPUs a host, 8 hosts)

# The pool's size by device: 2 GiB on a GPU, as tiny-vllm.
DEFAULT_CACHE = {"cuda": "2GiB", "cpu": "256MiB"}
# New tokens a chunked step feeds at most (docs/architecture.md, "A step with chunks"), by device
# and use: vLLM's (EngineArgs.get_batch_defaults), offline (its LLM class: generate, bench, chat,
# inspect-cache) and for the server (its OpenAI API server: serve, where a shorter step is a
# shorter stall of every stream being decoded). A GPU of 70 GiB or more gets the larger budgets, but
# not an A100, where vLLM measured them slower (its PR #17885). On a CPU, a chunk short enough that a
# decoding stream waits a fraction of a second for it.
LARGE_GPU_BYTES = 70 << 30
LARGE_GPU_MAX_BATCHED_TOKENS = 16384  # H100, H200, MI300X class
LARGE_GPU_SERVING_MAX_BATCHED_TOKENS = 8192
GPU_MAX_BATCHED_TOKENS = 8192  # any other GPU
GPU_SERVING_MAX_BATCHED_TOKENS = 2048
CPU_MAX_BATCHED_TOKENS = 256  # offline and serving
# Prompt tokens one step prefills without chunked prefill (the first prompt admitted goes whole):
# the scheduler's own cap, as before chunking, not the chunked budget's default by device
UNCHUNKED_MAX_BATCHED_TOKENS = 8192

# Temperatures below this sample as greedy (vLLM's choice): dividing the logits by a temperature
# near zero overflows them, and the distribution is the argmax's long before that.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # the most top tokens a step reports (vLLM's default cap)
# prompt tokens a step computes logits for, for a request with prompt_logprobs (a row of logits is
# the vocabulary's width: a whole 16k-token chunk's would be gigabytes)
PROMPT_LOGPROBS_ROWS = 512
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range, vLLM's check)
# The repetition penalty lies in [1/R, R]: a logit divided by one near 0 overflows float32 (inf, then a
# NaN distribution that no draw takes), and one past float32's range is inf (0 * inf is NaN)
MAX_REPETITION_PENALTY = 1e4
# what an answer may be held to (engine/structured.py)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Stop strings: at most this many a request, each at most this many characters. The engine searches
# each one in every step's new text and the (length - 1) characters before it (vLLM's incremental
# check), so a request's work per step stays within MAX_STOP_STRINGS x (new text + MAX_STOP_CHARS)
# characters whatever it asks for, and a neighbour's steps do not slow down for it
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_N = 128  # answers per prompt at most (generate's --n, a request's `n`): more would only queue behind one another
# Files a user names (a prompt file, a chat template, standard input, bench's texts) are read up to
# this many bytes: /dev/zero, or a pipe that never ends, is one line naming the file, not the end of memory
MAX_INPUT_FILE_BYTES = 64 << 20
# A model folder's own files read whole (config.json, tokenizer.json, tokenizer_config.json, the chat
# template): the largest real tokenizer.json is some 35 MB
MAX_MODEL_FILE_BYTES = 256 << 20


def option(default, help: str, *, flags: tuple[str, ...] = (), cli: bool = True, api: bool = False):
    """A declared option: a dataclass field with its default and what commands/options.py and
    serve/protocol.py make of it (see the module's docstring)."""
    return dataclasses.field(default=default, metadata={"help": help, "flags": flags, "cli": cli, "api": api})


def _usage_error(message: str, hint: str | None = None):
    from pagedcli.core.errors import UsageError  # (errors.py is light too, but only failures need it)

    return UsageError(message, hint)


@dataclass
class EngineOptions:
    """How an engine is built. Checked as it is made, so before anything slow is loaded."""

    model: str | None = option(None, (
        "Model folder, Hub id, `demo`, or random weights: `random:<preset>` or `random:<folder with config.json>`. "
        "Default: Llama-3.2-1B-Instruct if cached, else the built-in demo model."), flags=("--model", "-m"))
    device: str = option("auto", "auto, cpu or cuda.")
    dtype: str = option("auto", "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")
    batch: int = option(2, "Concurrent sequences (slots).", flags=("--batch", "-b"))  # as tiny-vllm's BATCH_SIZE
    block_size: int = option(16, "Tokens per KV block.")  # as in tiny-vllm and vLLM
    num_blocks: int | None = option(None, "Physical blocks in the pool (overrides --cache-size).")
    cache_size: str | None = option(None, (
        f"Pool size, e.g. 2GiB. Default: {DEFAULT_CACHE['cuda']} on CUDA, {DEFAULT_CACHE['cpu']} on CPU."))
    gpu_memory_utilization: float | None = option(None, (
        "Size the pool so the process uses this share of the GPU's memory (e.g. 0.9): what is left after the "
        "weights and the largest step's activations, measured by a profiling pass. Instead of --cache-size."))
    max_model_len: int | None = option(None, "Longest sequence, prompt included. Default: the model's, capped by "
                                             "what the pool holds.")
    eager: bool = option(False, "No CUDA graphs (slower; for debugging).")
    prefix_caching: bool = option(True, "Reuse the cached blocks of prompt prefixes seen before.")
    chunked_prefill: bool = option(True, (
        "Steps carry every running sequence's next token plus chunks of prompts, up to --max-num-batched-tokens, "
        "so decoding never waits for a long prompt's prefill."))
    max_num_batched_tokens: int | None = option(None, (
        "New tokens one step feeds at most (the chunk budget). "
        f"Default (vLLM's): on a GPU of 70 GiB or more but an A100 {LARGE_GPU_MAX_BATCHED_TOKENS}, serve "
        f"{LARGE_GPU_SERVING_MAX_BATCHED_TOKENS}; on another GPU {GPU_MAX_BATCHED_TOKENS}, serve "
        f"{GPU_SERVING_MAX_BATCHED_TOKENS}; on CPU {CPU_MAX_BATCHED_TOKENS}."))
    kv_cache_dtype: str = option("auto", (
        "auto (the model's dtype) or fp8 (also fp8_e4m3): K and V stored as float8 e4m3, 1 byte an element, so "
        "the same pool holds twice the tokens of bf16; scaled per layer and KV head by the checkpoint's "
        "k_scale/v_scale, else 1.0 (vLLM's default)."))
    quantization: str = option("none", (
        "none, fp8, int4 or int8. fp8: the linear layers' and the LM head's weights as float8 e4m3 with a scale per output "
        "channel, quantized at load (the embeddings stay in --dtype for their lookups); over 2 rows (prefill, "
        "larger batches) the activations too, per token, for fp8 tensor cores (W8A8), so a greedy text can "
        "depend on the batch. A checkpoint that ships fp8 weights (quant_method fp8) has its fp8 tensors read "
        "as they are; with none they are dequantized to --dtype. int4: 4-bit values with a scale and minimum per "
        "group of 128 inputs (64 or 32 where 128 does not divide a layer), int8: 8-bit values with a scale per "
        "output channel, both rounded to nearest at load, the activations left in --dtype (W4A16, W8A16)."))
    threads: int | None = option(None, (
        "CPU threads for a run on the CPU (llama.cpp's -t). Default: the cores torch sees, but 1 for a model of a "
        "few MB such as the built-in demo, whose steps are too small to share between threads. With "
        "--tensor-parallel-size, each rank's (default: the cores shared among the ranks)."))
    tensor_parallel_size: int = option(1, (
        "Ranks that split every layer's heads and columns and every KV block's heads (vLLM's -tp): a process "
        "each, one GPU each on CUDA (NCCL), a share of the cores each on the CPU (gloo). Started here, or one "
        "a process under torchrun."), flags=("--tensor-parallel-size", "-tp"))
    overlap: bool = option(True, "On a GPU, queue the next decode step before this one's tokens reach the host, "
                                 "so Python's work per step hides behind the GPU's.")
    shuffle_blocks: int | None = option(None, "Hand blocks out in an order shuffled by this seed (tests, demos).",
                                        cli=False)
    seed: int = option(0, "The seed of random weights.", cli=False)
    serving: bool = option(False, "For `pagedcli serve`, whose default step budget is smaller on a GPU.", cli=False)

    def __post_init__(self):
        if self.kv_cache_dtype == "fp8_e4m3":  # vLLM's other name for it
            self.kv_cache_dtype = "fp8"
        if self.cache_size is not None and not self.cache_size.strip():  # (not the default: a value left empty)
            raise _usage_error(f"`cache_size` {self.cache_size!r} is not a size",
                               "write it like 2GiB, 512MiB or 100MB, or leave it out for the default")
        if self.model is not None and not self.model.strip():
            raise _usage_error("`model` is empty", "pass a model folder, a Hub id, or `demo`")
        if self.device not in DEVICES:
            raise _usage_error(f"`device` {self.device!r} is not known", "use auto, cpu or cuda")
        if self.batch < 1:
            raise _usage_error(f"`batch` {self.batch}: needs at least one slot", "use `batch` 1 or more")
        if self.batch > MAX_ID:
            raise _usage_error(f"`batch` {self.batch}: more slots than the {MAX_ID:,} a block table can number",
                               "use a smaller `batch`")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise _usage_error(f"`max_model_len` {self.max_model_len}: must be at least 1",
                               "leave it out for the model's own")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _usage_error(f"`kv_cache_dtype` {self.kv_cache_dtype!r} is not known",
                               "use auto (the model's dtype) or fp8 (also fp8_e4m3)")
        if self.quantization not in QUANTIZATIONS:
            raise _usage_error(f"`quantization` {self.quantization!r} is not known", f"use {' or '.join(QUANTIZATIONS)}")
        if self.gpu_memory_utilization is not None:
            check_fraction(self.gpu_memory_utilization)
            given = [f"`{name}`" for name in ("cache_size", "num_blocks") if getattr(self, name) is not None]
            if given:
                raise _usage_error(f"`gpu_memory_utilization` and {given[0]} both size the pool", "give one of them")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise _usage_error(f"`threads` {self.threads}: needs 1 to {MAX_THREADS}", "leave it out for the cores torch sees")
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
            raise _usage_error(f"`tensor_parallel_size` {self.tensor_parallel_size}: needs 1 to {MAX_TENSOR_PARALLEL}",
                               "leave it out to run on one device")
        n = self.max_num_batched_tokens
        if n is not None and n < 1:
            raise _usage_error(f"`max_num_batched_tokens` {n}: must be at least 1", "leave it out for the device's default")
        if n is not None and self.chunked_prefill and n < self.batch:
            raise _usage_error(f"`max_num_batched_tokens` {n} is below `batch` {self.batch}: a step must hold a token "
                               "for every running sequence", f"use `max_num_batched_tokens` {self.batch} or more")

    def batched_tokens(self, device: torch.device) -> int:
        """The step's token budget: as given, or the default for the device and for serving or not
        (with chunked prefill at least a token per slot; without, the scheduler's own)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if not self.chunked_prefill:
            return UNCHUNKED_MAX_BATCHED_TOKENS
        return max(default_max_batched_tokens(device, self.serving), self.batch)


def check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:  # (NaN fails it too)
        raise _usage_error(f"`gpu_memory_utilization` {fraction}: must be above 0 and at most 1",
                           "e.g. 0.9: the share of the GPU's memory the process may use")


def default_max_batched_tokens(device: torch.device, serving: bool) -> int:
    """The step budget when none is given: on CUDA it asks the GPU for its memory and name."""
    if device.type != "cuda":
        return CPU_MAX_BATCHED_TOKENS
    if is_large_gpu(device):
        return LARGE_GPU_SERVING_MAX_BATCHED_TOKENS if serving else LARGE_GPU_MAX_BATCHED_TOKENS
    return GPU_SERVING_MAX_BATCHED_TOKENS if serving else GPU_MAX_BATCHED_TOKENS


def is_large_gpu(device: torch.device) -> bool:
    """vLLM's test for its larger budgets: 70 GiB or more, and not an A100."""
    import torch  # here, not above: the command line imports this module before torch

    props = torch.cuda.get_device_properties(device)
    return props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of sampling, with vLLM's names and meanings (engine/logits_processors.py)."""

    max_tokens: int = option(256, "New tokens per prompt, at most.", api=True)
    temperature: float = option(0.0, "0 is greedy. Default: the model's generation_config.json when it samples, "
                                      "else 0.", api=True)
    top_k: int = option(0, "Sample from the k likeliest tokens (0: off).", api=True)
    top_p: float = option(1.0, "Sample from the smallest set holding this probability (1: off).", api=True)
    min_p: float = option(0.0, "Drop tokens less likely than this times the likeliest (0: off).", api=True)
    repetition_penalty: float = option(1.0, "Divide the logits of tokens in the prompt or answer so far by this "
                                            "(1: off; >1 repeats less).", api=True)
    presence_penalty: float = option(0.0, "Lower the logit of every token the answer holds by this, -2 to 2 "
                                          "(0: off).", api=True)
    frequency_penalty: float = option(0.0, "Lower a token's logit by this times its count in the answer, -2 to 2 "
                                           "(0: off).", api=True)
    stop: tuple[str, ...] = option((), f"End the answer before this text (repeatable: up to {MAX_STOP_STRINGS}, each "
                                       f"up to {MAX_STOP_CHARS:,} characters).")  # the first it contains
    logprobs: int | None = option(None, "With --json: each token's log-probability and the N likeliest tokens' "
                                        "(0 to 20).")  # None: off
    prompt_logprobs: int | None = option(None, "With --json: each prompt token's log-probability and the N "
                                               "likeliest there (0 to 20; the first token's is null).")
    seed: int | None = option(None, "Seed for sampling (the i-th answer uses seed + i).", api=True)
    ignore_eos: bool = option(False, "Keep going past the model's stop tokens.", api=True)
    # (kind, text): the answer held to a JSON schema ("json"), any JSON object ("json_object", text ""),
    # a regex, one of a JSON list of strings ("choice") or an EBNF / GBNF grammar (engine/structured.py)
    structured: tuple[str, str] | None = option(None, "The answer held to a JSON schema, a regex, a choice or a "
                                                      "grammar (engine/structured.py).", cli=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def problem(self) -> tuple[str, object, str, str | None] | None:
        """The first setting no sampler can use, as (field, value, why, hint); None if all are fine."""
        def finite(x) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        checks = [
            ("temperature", finite(self.temperature) and self.temperature >= 0,
             "must be 0 (greedy) or a positive number", None),
            ("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]", "1 turns it off"),
            ("top_k", self.top_k >= 0, "must be 0 (off) or more", None),
            ("min_p", finite(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]", "0 turns it off"),
            ("repetition_penalty", finite(self.repetition_penalty)
             and 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"must be a positive number from {1 / MAX_REPETITION_PENALTY:g} to {MAX_REPETITION_PENALTY:g}",
             "1 turns it off; above 1 discourages repeats"),
            ("presence_penalty", finite(self.presence_penalty) and abs(self.presence_penalty) <= MAX_PENALTY,
             f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", "0 turns it off"),
            ("frequency_penalty", finite(self.frequency_penalty) and abs(self.frequency_penalty) <= MAX_PENALTY,
             f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", "0 turns it off"),
            ("max_tokens", self.max_tokens >= 1, "must be at least 1", None),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in 64 bits",
             "use a number from -2**63 to 2**63 - 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be from 0 to {MAX_LOGPROBS}", "0 gives only the chosen token's"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be from 0 to {MAX_LOGPROBS}", "0 gives only each prompt token's own"),
        ]
        for name, ok, why, hint in checks:
            if not ok:
                return name, getattr(self, name), why, hint
        if len(self.stop) > MAX_STOP_STRINGS:
            return ("stop", f"({len(self.stop):,} strings)", f"at most {MAX_STOP_STRINGS} stop strings",
                    "keep the ones that matter")
        if self.structured is not None and self.structured[0] not in STRUCTURED_KINDS:
            return "structured", self.structured[0], f"is not one of {', '.join(STRUCTURED_KINDS)}", None
        if "" in self.stop:
            return "stop", "''", "a stop string must not be empty", None
        long = next((s for s in self.stop if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            return ("stop", f"{long[:20]!r}... ({len(long):,} characters)",
                    f"a stop string may hold at most {MAX_STOP_CHARS:,} characters", "use a shorter one")
        return None


def declared(cls) -> list[dataclasses.Field]:
    """The declared options of EngineOptions or SamplingParams, in order."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]
