"""The options more than one command takes, each declared once: the engine's (EngineFlags) and the
requests' and their sampling (RequestFlags). `flag_group` adds a group's fields to a command's
options and hands them to the command as one object."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from pagedcli.defaults import (CPU_MAX_BATCHED_TOKENS, DEFAULT_CACHE, DEFAULTS, GPU_MAX_BATCHED_TOKENS,
                                GPU_SERVING_MAX_BATCHED_TOKENS, LARGE_GPU_MAX_BATCHED_TOKENS,
                                LARGE_GPU_SERVING_MAX_BATCHED_TOKENS)
from pagedcli.errors import UsageError, name_settings
from pagedcli.model.presets import RANDOM_PRESETS


@dataclasses.dataclass
class EngineFlags:
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="Model folder, Hub id, `demo`, or random weights: `random:<preset>` or "
        "`random:<folder with config.json>`. Default: Llama-3.2-1B-Instruct if cached, else the built-in demo model. "
        f"Presets (public checkpoints' shapes): {', '.join(RANDOM_PRESETS)}.")] = None
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = DEFAULTS.device
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.")] = DEFAULTS.dtype
    batch: Annotated[int, typer.Option("--batch", "-b", help="Concurrent sequences (slots).")] = DEFAULTS.batch
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = DEFAULTS.block_size
    num_blocks: Annotated[Optional[int], typer.Option(help="Physical blocks in the pool (overrides --cache-size).")] = None
    cache_size: Annotated[Optional[str], typer.Option(
        help=f"Pool size, e.g. 2GiB. Default: {DEFAULT_CACHE['cuda']} on CUDA, {DEFAULT_CACHE['cpu']} on CPU.")] = None
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(
        help="Size the pool so the process uses this share of the GPU's memory (e.g. 0.9): what is left after "
        "the weights and the largest step's activations, measured by a profiling pass. Instead of --cache-size.")] = None
    max_model_len: Annotated[Optional[int], typer.Option(
        help="Longest sequence, prompt included. Default: the model's, capped by what the pool holds.")] = None
    eager: Annotated[bool, typer.Option(help="No CUDA graphs (slower; for debugging).")] = DEFAULTS.eager
    prefix_caching: Annotated[bool, typer.Option(help="Reuse the cached blocks of prompt prefixes seen before.")] = DEFAULTS.prefix_caching
    chunked_prefill: Annotated[bool, typer.Option(
        help="Steps carry every running sequence's next token plus chunks of prompts, up to "
        "--max-num-batched-tokens, so decoding never waits for a long prompt's prefill.")] = DEFAULTS.chunked_prefill
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(
        help="New tokens one step feeds at most (the chunk budget). "
        f"Default (vLLM's): on a GPU of 70 GiB or more but an A100 {LARGE_GPU_MAX_BATCHED_TOKENS}, serve "
        f"{LARGE_GPU_SERVING_MAX_BATCHED_TOKENS}; on another GPU {GPU_MAX_BATCHED_TOKENS}, serve "
        f"{GPU_SERVING_MAX_BATCHED_TOKENS}; on CPU {CPU_MAX_BATCHED_TOKENS}.")] = None
    kv_cache_dtype: Annotated[str, typer.Option(
        help="auto (the model's dtype) or fp8 (also fp8_e4m3): K and V stored as float8 e4m3, 1 byte an element, "
        "so the same pool holds twice the tokens of bf16; scaled per layer and KV head by the checkpoint's "
        "k_scale/v_scale, else 1.0 (vLLM's default).")] = DEFAULTS.kv_cache_dtype
    quantization: Annotated[str, typer.Option(
        help="none or fp8: the linear layers' and the LM head's weights as float8 e4m3 with a scale per output "
        "channel, quantized at load (the embeddings stay in --dtype for their lookups); over 2 rows (prefill, "
        "larger batches) the activations too, per token, for fp8 tensor cores (W8A8), so a greedy text can "
        "depend on the batch. "
        "A checkpoint that ships fp8 weights (quant_method fp8) has its fp8 tensors read as they are; "
        "with none they are dequantized to --dtype.")] = DEFAULTS.quantization
    overlap: Annotated[bool, typer.Option(help="On a GPU, queue the next decode step before this one's tokens reach "
                                          "the host, so Python's work per step hides behind the GPU's.")] = DEFAULTS.overlap

    def options(self, **overrides):
        """The EngineOptions these flags ask for (`overrides`: what the command decides itself)."""
        from pagedcli.model.loader import EngineOptions

        if self.model is not None and not self.model.strip():
            raise UsageError("--model is empty", "pass a model folder, a Hub id, or `demo`")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UsageError(f"--max-model-len {self.max_model_len}: must be at least 1", "leave it out for the model's own")
        return EngineOptions(**(dataclasses.asdict(self) | overrides))


@dataclasses.dataclass
class RequestFlags:
    prompts: Annotated[Optional[list[str]], typer.Argument(
        help="Prompts; several run together. `-`: read them from standard input, as with none and input piped in.",
        show_default=False)] = None
    prompt_file: Annotated[Optional[Path], typer.Option(
        help="A UTF-8 file with one prompt per line (`-`: standard input).")] = None
    prompt_separator: Annotated[str, typer.Option(
        help=r"What ends a prompt in a prompt file or standard input, with \n, \t, \r and \\ read as escapes: "
        r"'\n\n' for prompts of several lines between blank lines, '' for the whole input as one prompt.")] = r"\n"
    chat: Annotated[Optional[bool], typer.Option(
        "--chat/--raw", help="Wrap prompts in the model's chat template (default when it has one) or feed them as is.")] = None
    system: Annotated[Optional[str], typer.Option(help="A system message before each prompt, in the chat template.",
                                                  show_default=False)] = None
    chat_template: Annotated[Optional[Path], typer.Option(
        help="A Jinja chat template file (as vLLM's --chat-template), in place of the model folder's.",
        show_default=False)] = None
    max_tokens: Annotated[int, typer.Option(help="New tokens per prompt, at most.")] = DEFAULTS.max_tokens
    temperature: Annotated[Optional[float], typer.Option(
        help="0 is greedy. Default: the model's generation_config.json when it samples, else 0.", show_default=False)] = None
    top_k: Annotated[Optional[int], typer.Option(help="Sample from the k likeliest tokens (0: off).", show_default=False)] = None
    top_p: Annotated[Optional[float], typer.Option(
        help="Sample from the smallest set holding this probability (1: off).", show_default=False)] = None
    min_p: Annotated[Optional[float], typer.Option(
        help="Drop tokens less likely than this times the likeliest (0: off).", show_default=False)] = None
    repetition_penalty: Annotated[Optional[float], typer.Option(
        help="Divide the logits of tokens in the prompt or answer so far by this (1: off; >1 repeats less).",
        show_default=False)] = None
    presence_penalty: Annotated[Optional[float], typer.Option(
        help="Lower the logit of every token the answer holds by this, -2 to 2 (0: off).", show_default=False)] = None
    frequency_penalty: Annotated[Optional[float], typer.Option(
        help="Lower a token's logit by this times its count in the answer, -2 to 2 (0: off).",
        show_default=False)] = None
    stop: Annotated[Optional[list[str]], typer.Option(
        help="End the answer before this text (repeatable).", show_default=False)] = None
    logprobs: Annotated[Optional[int], typer.Option(
        help="With --json: each token's log-probability and the N likeliest tokens' (0 to 20).",
        show_default=False)] = None
    seed: Annotated[Optional[int], typer.Option(help="Seed for sampling (the i-th answer uses seed + i).")] = None
    ignore_eos: Annotated[bool, typer.Option(help="Keep going past the model's stop tokens.")] = DEFAULTS.ignore_eos
    samples: Annotated[int, typer.Option("--n", help="Answers per prompt; they share the prompt's blocks "
                                         "(copy-on-write).")] = 1

    def sampling(self) -> dict:
        """The sampling options as given (None: not given)."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                    seed=self.seed, stop=tuple(self.stop) if self.stop else None, logprobs=self.logprobs)


def flag_group(group: type, param: str, leave_out: dict | None = None, first: bool = False):
    """Give a command the fields of `group` (a dataclass of Typer options) as its own options, and
    the values as one `group` object in its parameter `param`. `leave_out`: fields the command does
    not offer, with the value they take; `first`: list them before the command's own options."""
    leave_out = leave_out or {}
    hints = typing.get_type_hints(group, include_extras=True)
    fields = [f for f in dataclasses.fields(group) if f.name not in leave_out]
    added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
             for f in fields]

    def decorate(command):
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != param]

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {f.name: kwargs.pop(f.name) for f in fields}
            return command(**kwargs, **{param: group(**values, **leave_out)})

        params = added + own if first else own + added
        wrapper.__signature__ = inspect.Signature(params)  # what Typer reads the options from
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def _flags() -> dict[str, str]:
    """Each setting's flag, by the field name core messages give it (pagedcli.errors.name_settings)."""
    flags = {"raw": "--raw"}  # the off side of --chat/--raw
    for group in (EngineFlags, RequestFlags):
        for name, hint in typing.get_type_hints(group, include_extras=True).items():
            info = hint.__metadata__[0]  # in Annotated, an Option's first name is its `default`
            decls = [d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("--")]
            flags[name] = decls[0].split("/")[0] if decls else "--" + name.replace("_", "-")
    return flags


FLAGS = _flags()


def with_flags(text: str) -> str:
    """A core message as the command line shows it: each setting named by its flag."""
    return name_settings(text, FLAGS)
