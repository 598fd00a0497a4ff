"""`pagedcli generate`: prompts in, answers streamed out, through the engine's step loop."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pagedcli.commands.exits import exit_for_failures, friendly_errors, notice, report_failures
from pagedcli.commands.options import EngineFlags, RequestFlags, flag_group
from pagedcli.errors import RunError, UsageError, plural

if TYPE_CHECKING:  # the engine and torch load once a command runs, not for --help
    from pagedcli.commands.output import JsonPrinter, TextPrinter
    from pagedcli.engine.engine import Engine
    from pagedcli.engine.sequence import SamplingParams, Sequence


def read_prompts(prompts: list[str], prompt_file: Path | None) -> list[str]:
    """Arguments first, then the file's non-empty lines. Lines end at "\n" (or "\r\n") only, not
    at the other breaks str.splitlines knows (U+2028, U+0085, form feed...), which a prompt may hold;
    a byte-order mark at the start of the file is not part of its first prompt."""
    prompts = list(prompts)
    for i, prompt in enumerate(prompts):
        check_text(prompt, f"prompt {i + 1}")
    if prompt_file is not None:
        try:
            text = Path(prompt_file).read_bytes().decode("utf-8-sig")
        except FileNotFoundError:
            raise UsageError(f"--prompt-file {prompt_file}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"--prompt-file {prompt_file}: is a folder", "give a text file, one prompt per line") from None
        except PermissionError:
            raise UsageError(f"--prompt-file {prompt_file}: cannot be read (permission denied)") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"--prompt-file {prompt_file}: not UTF-8 text (byte {e.start})",
                             "save it as UTF-8, one prompt per line") from None
        prompts += [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        if prompt_file is not None:
            raise UsageError(f"--prompt-file {prompt_file}: has no prompts (every line is empty)",
                             "write one prompt per line")
        raise UsageError("no prompt given", 'pass one, e.g. pagedcli generate "ROMEO:", or use --prompt-file')
    return prompts


def check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode: an argument with bytes that are not UTF-8 arrives
    with them as lone surrogates (Python's surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise UsageError(f"{what} is not valid UTF-8 text ({bad} at character {e.start + 1})",
                         "pass UTF-8 text, or put the prompts in a UTF-8 --prompt-file") from None


def sampling_defaults(params: SamplingParams, generation_config: dict, given: set[str],
                      source: str = "generation_config.json") -> SamplingParams:
    """The model's own sampling settings (generation_config.json: do_sample, temperature, top_k,
    top_p), as transformers and vLLM apply them, for every option the user did not give. A value
    the options would refuse is refused here too, naming the file (`source`)."""
    do_sample = generation_config.get("do_sample")
    if not isinstance(do_sample, (bool, type(None))):  # "false" is true to Python: never guess
        if "temperature" in given:  # the option decides greedy or not; the file's other settings are not used
            return params
        raise RunError(f"{source}: do_sample {do_sample!r} is not true or false",
                       "fix the file (true or false, without quotes), or pass --temperature")
    if not do_sample:
        return params
    defaults = {"temperature": generation_config.get("temperature", 1.0), "top_k": generation_config.get("top_k", 0),
                "top_p": generation_config.get("top_p", 1.0)}
    taken = {k: v for k, v in defaults.items() if k not in given and v is not None}
    # a broken model folder is not a mistake in the command: exit code 1, as for its other files
    for k, v in taken.items():
        if isinstance(v, bool) or not isinstance(v, int if k == "top_k" else (int, float)):
            raise RunError(f"{source}: {k} {v!r} is not a {'whole ' if k == 'top_k' else ''}number",
                           f"fix the file, or pass --{k.replace('_', '-')}")
    params = replace(params, **taken)
    check_sampling(params, source)
    return params


def check_sampling(params: SamplingParams, source: str | None = None) -> None:
    """Refuse settings no sampler can use. `source`: the file they came from (a RunError naming the
    file's key and the option that overrides it), else the options (a UsageError)."""
    def bad(option: str, value, why: str, hint: str | None = None):
        if source is None:
            raise UsageError(f"{option} {value}: {why}", hint)
        key = option.removeprefix("--").replace("-", "_")
        raise RunError(f"{source}: {key} {value}: {why}", f"fix the file, or pass {option}")

    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        bad("--temperature", params.temperature, "must be 0 (greedy) or a positive number")
    if not 0 < params.top_p <= 1:
        bad("--top-p", params.top_p, "must be in (0, 1]", "1 turns it off")
    if params.top_k < 0:
        bad("--top-k", params.top_k, "must be 0 (off) or more")
    if params.max_tokens < 1:
        raise UsageError(f"--max-tokens {params.max_tokens}: must be at least 1")
    if params.seed is not None and not -(2**63) <= params.seed < 2**63:
        raise UsageError(f"--seed {params.seed}: must fit in 64 bits", "use a number from -2**63 to 2**63 - 1")


def add_requests(engine: Engine, tokenizer, prompts: list[str], params: SamplingParams, chat: bool,
                 samples: int = 1) -> list[Sequence]:
    """`samples` answers per prompt (sharing the prompt's blocks when more than one). The i-th
    answer overall samples with seed + i, so it does not depend on what else shares the batch."""
    seqs = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, chat=chat)
        answer_params = [replace(params, seed=None if params.seed is None else params.seed + len(seqs) + j)
                         for j in range(samples)]
        if samples == 1:
            seqs.append(engine.add_request(ids, answer_params[0], prompt))
        else:
            seqs += engine.add_parallel(ids, answer_params, prompt)
    return seqs


def stream_answers(engine: Engine, printer: TextPrinter | JsonPrinter, seqs: list[Sequence], on_step=None) -> None:
    """Step until every request is done, feeding new tokens to the printer. Ctrl-C stops the
    engine (every block goes back) and leaves what was printed on the screen."""
    try:
        while engine.has_unfinished:
            out = engine.step()
            for seq in out.seqs:
                printer.update(seq)
            printer.flush()
            if on_step is not None:
                on_step(out)
    except KeyboardInterrupt:
        for seq in seqs:
            printer.update(seq)
        printer.interrupt()
        engine.abort_all()
        raise
    printer.flush()


def summary(seqs: list[Sequence], elapsed: float, engine: Engine, samples: int = 1) -> str:
    n = sum(len(s.output_token_ids) for s in seqs)
    rate = n / elapsed if elapsed > 0 else 0.0
    parts = [f"{plural(n, 'token')} in {elapsed:.2f} s ({rate:.1f} tokens/s)", plural(len(seqs) // samples, "prompt")]
    if samples > 1:
        parts[-1] += f", {plural(len(seqs), 'answer')}"
    if engine.scheduler.num_preemptions:
        parts.append(plural(engine.scheduler.num_preemptions, "preemption"))
    cut = sum(s.finish_reason == "length" and len(s.output_token_ids) < s.params.max_tokens for s in seqs)
    if cut:  # stopped by the length limit, not by --max-tokens: say which limit, and how to lift it
        limit = engine.cache.max_model_len
        why = "what the pool holds: use a larger --cache-size" if limit == engine.cache.geometry.pool_tokens \
            else "the model's maximum length, or --max-model-len"
        parts.append(f"{plural(cut, 'answer')} stopped at {plural(limit, 'token')}, prompt included ({why})")
    return ", ".join(parts)


def start_requests(engine_flags: EngineFlags, requests: RequestFlags, command: str, say=notice, **overrides):
    """Everything generate and inspect-cache share: check the input, load the model, queue the
    requests. Returns the loaded model, the sequences and whether the chat template is used.
    `say`: where the loader's notices go (nowhere with --quiet)."""
    from pagedcli.engine.sequence import SamplingParams
    from pagedcli.model.loader import load

    opts = engine_flags.options(**overrides)
    sampling = requests.sampling()
    given = {k for k, v in sampling.items() if v is not None}
    params = SamplingParams(**{k: sampling[k] for k in given})  # the rest: SamplingParams' defaults
    check_sampling(params)
    if requests.samples < 1:
        raise UsageError(f"--n {requests.samples}: needs at least one answer per prompt")
    texts = read_prompts(requests.prompts or [], requests.prompt_file)
    chat = requests.chat

    def check(source, tokenizer) -> None:  # before the weights are read
        if tokenizer is None:
            raise UsageError(f"--model {source.name} has no tokenizer", f"{command} needs a model folder with tokenizer.json")
        if chat and not tokenizer.has_chat_template:
            raise UsageError(f"--chat: model {source.name} has no chat template", "use --raw")

    loaded = load(opts, say, check)
    use_chat = loaded.tokenizer.has_chat_template if chat is None else chat
    params = sampling_defaults(params, loaded.source.generation_config, given,
                               f"{loaded.source.name}'s generation_config.json")
    seqs = add_requests(loaded.engine, loaded.tokenizer, texts, params, use_chat, requests.samples)
    report_failures(seqs, requests.samples)
    return loaded, seqs, use_chat


@friendly_errors
@flag_group(RequestFlags, "requests", first=True)
@flag_group(EngineFlags, "engine_flags")
def generate(
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per answer on stdout, nothing else.")] = False,
    live: Annotated[bool, typer.Option("--live", help="Watch the KV cache while it runs (on a terminal only).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the answers on stdout: no prompts, labels, "
                                        "notices or statistics (errors still go to stderr).")] = False,
    *, requests: RequestFlags, engine_flags: EngineFlags,
):
    """Generate text for one or more prompts, streamed as it comes."""
    from pagedcli.commands.output import JsonPrinter, TextPrinter

    say = (lambda _: None) if quiet else notice
    loaded, seqs, use_chat = start_requests(engine_flags, requests, "generate", say)
    engine, samples = loaded.engine, requests.samples
    view = None
    if live:
        from pagedcli.commands.live_view import open_live_view

        view = open_live_view(engine, loaded.tokenizer.decode, json_output)
        if view is None and not json_output:
            say("--live: stdout is not a terminal, so no live view")
    out = view.out if view else None
    printer = (JsonPrinter(loaded.tokenizer, seqs, samples, out) if json_output
               else TextPrinter(loaded.tokenizer, seqs, samples, echo_prompt=not (use_chat or quiet), out=out,
                                labelled=not quiet))
    refused = {s.id for s in seqs if s.error}
    start = time.perf_counter()
    with view or contextlib.nullcontext():
        stream_answers(engine, printer, seqs, on_step=view.on_step if view else None)
    report_failures(seqs, samples, refused)
    if not json_output:
        say(summary(seqs, time.perf_counter() - start, engine, samples))
    exit_for_failures(seqs, refused)
