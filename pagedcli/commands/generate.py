"""`pagedcli generate`: prompts in, answers streamed out, through the engine's step loop."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from pagedcli.commands.exits import exit_for_failures, friendly_errors, need_stdout, notice, report_failures
from pagedcli.commands.options import EngineFlags, RequestFlags, flag_group
from pagedcli.console.prompts import prompt_separator, read_prompts
from pagedcli.core.errors import RunError, UsageError, plural

if TYPE_CHECKING:  # the engine and torch load once a command runs, not for --help
    from pagedcli.commands.output import JsonPrinter, TextPrinter
    from pagedcli.core.options import SamplingParams
    from pagedcli.engine.engine import Engine
    from pagedcli.engine.sequence import Sequence


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
    """Refuse settings no sampler can use (SamplingParams.problem). `source`: the file they came
    from (a RunError naming the file's key and the option that overrides it), else the options (a
    UsageError naming the option)."""
    problem = params.problem()
    if problem is None:
        return
    name, value, why, hint = problem
    if source is None:
        raise UsageError(f"`{name}` {value}: {why}", hint)
    raise RunError(f"{source}: {name} {value}: {why}", f"fix the file, or pass `{name}`")


def add_requests(engine: Engine, tokenizer, prompts: list[str], params: SamplingParams, chat: bool,
                 samples: int = 1, system: str | None = None) -> list[Sequence]:
    """`samples` answers per prompt (sharing the prompt's blocks when more than one). The i-th
    answer overall samples with seed + i, so it does not depend on what else shares the batch."""
    seqs = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, chat=chat, system=system)
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
    cut = length_cut(seqs, engine)
    if cut:
        parts.append(cut)
    return ", ".join(parts)


def length_cut(seqs: list[Sequence], engine: Engine) -> str | None:
    """The answers the length limit stopped short of --max-tokens: how many, and how to lift it."""
    cut = sum(s.finish_reason == "length" and len(s.output_token_ids) < s.params.max_tokens for s in seqs)
    if not cut:
        return None
    limit = engine.cache.max_model_len
    why = "what the pool holds: use a larger --cache-size" if limit == engine.cache.geometry.pool_tokens \
        else "the model's maximum length, or --max-model-len"
    return f"{plural(cut, 'answer')} stopped at {plural(limit, 'token')}, prompt included ({why})"


def request_params(requests: RequestFlags) -> tuple[SamplingParams, set[str]]:
    """The sampling the options ask for (the rest: SamplingParams' defaults), and which they gave."""
    from pagedcli.core.options import SamplingParams

    sampling = requests.sampling()
    given = {k for k, v in sampling.items() if v is not None}
    params = SamplingParams(**{k: sampling[k] for k in given})
    check_sampling(params)
    return params, given


def template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs: a JSON object, or nothing."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--chat-template-kwargs {text!r} is not JSON ({e})",
                         "give a JSON object, e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"--chat-template-kwargs {text!r} is not a JSON object",
                         "give a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def check_samples(samples: int) -> None:
    """--n within its bounds (the server's `n` has the same), before anything is read or loaded."""
    from pagedcli.core.options import MAX_N

    if not 1 <= samples <= MAX_N:
        raise UsageError(f"--n {samples}: must be from 1 to {MAX_N} answers per prompt",
                         "run the prompt again for more" if samples > MAX_N else None)


def load_for_text(engine_flags: EngineFlags, requests: RequestFlags, command: str, chat: bool | None, say=notice,
                  **overrides):
    """Load the model for a command that needs its tokenizer (and, `chat` True, a chat template:
    --chat-template's, else the folder's), refusing one that lacks them before its weights are read.
    `say`: where the model's and the build's notices go (nowhere with --quiet)."""
    from pagedcli.engine.build import load

    opts = engine_flags.options(**overrides)

    def check(source, tokenizer) -> None:  # before the weights are read
        if tokenizer is None and source.random:
            raise UsageError(f"--model {source.name}: random weights are for bench and token-id requests, "
                             f"not {command}", "give a model folder or Hub name without random:")
        if tokenizer is None:
            raise UsageError(f"--model {source.name} has no tokenizer", f"{command} needs a model folder with tokenizer.json")
        if requests.chat_template is not None:
            tokenizer.use_chat_template(requests.chat_template)
        tokenizer.template_kwargs = template_kwargs(requests.chat_template_kwargs)
        if tokenizer.has_chat_template:
            return
        if command == "chat":
            raise UsageError(f"model {source.name} has no chat template",
                             "give one with --chat-template FILE, a Jinja file such as a chat model's chat_template.jinja")
        if chat:
            raise UsageError(f"--chat: model {source.name} has no chat template", "use --raw, or give --chat-template FILE")
        if requests.system is not None:
            raise UsageError(f"--system: model {source.name} has no chat template to put it in",
                             "give one with --chat-template FILE")

    return load(opts, say, check)


def start_requests(engine_flags: EngineFlags, requests: RequestFlags, command: str, say=notice, **overrides):
    """Everything generate and inspect-cache share: check the input, load the model, queue the
    requests. Returns the loaded model, the sequences and whether the chat template is used.
    `say`: where the model's and the build's notices go (nowhere with --quiet)."""
    need_stdout()
    params, given = request_params(requests)
    check_samples(requests.samples)
    chat = requests.chat
    if chat is False and requests.system is not None:
        raise UsageError("--system goes in the chat template, which --raw leaves out", "leave out one of them")
    texts = read_prompts(requests.prompts or [], requests.prompt_file, prompt_separator(requests.prompt_separator),
                         command)
    loaded = load_for_text(engine_flags, requests, command, chat, say, **overrides)
    use_chat = loaded.tokenizer.has_chat_template if chat is None else chat
    params = sampling_defaults(params, loaded.source.generation_config, given,
                               f"{loaded.source.name}'s generation_config.json")
    seqs = add_requests(loaded.engine, loaded.tokenizer, texts, params, use_chat, requests.samples, requests.system)
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
    if requests.logprobs is not None and not json_output:
        say("--logprobs: the log-probabilities are in the --json output only")
    engine, samples = loaded.engine, requests.samples
    view = None
    if live:
        from pagedcli.console.live_view import open_live_view

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
    elif cut := length_cut(seqs, engine):  # JSON has finish_reason "length" for both limits: say which
        say(cut)
    exit_for_failures(seqs, refused)
