"""`pagedcli generate`: prompts in, answers streamed out, through the engine's step loop."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pagedcli.engine import Engine
from pagedcli.errors import UsageError
from pagedcli.output import JsonPrinter, TextPrinter
from pagedcli.sequence import SamplingParams, Sequence


def read_prompts(prompts: list[str], prompt_file: Path | None) -> list[str]:
    """Arguments first, then the file's non-empty lines."""
    prompts = list(prompts)
    if prompt_file is not None:
        try:
            text = Path(prompt_file).read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise UsageError(f"--prompt-file {prompt_file}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"--prompt-file {prompt_file}: is a folder", "give a text file, one prompt per line") from None
        except PermissionError:
            raise UsageError(f"--prompt-file {prompt_file}: cannot be read (permission denied)") from None
        except UnicodeDecodeError as e:
            raise UsageError(f"--prompt-file {prompt_file}: not UTF-8 text (byte {e.start})",
                             "save it as UTF-8, one prompt per line") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UsageError("no prompt given", 'pass one, e.g. pagedcli generate "ROMEO:", or use --prompt-file')
    return prompts


def sampling_defaults(params: SamplingParams, generation_config: dict, given: set[str]) -> SamplingParams:
    """The model's own sampling settings (generation_config.json: do_sample, temperature, top_k,
    top_p), as transformers and vLLM apply them, for every option the user did not give."""
    if not generation_config.get("do_sample"):
        return params
    defaults = {"temperature": generation_config.get("temperature", 1.0), "top_k": generation_config.get("top_k", 0),
                "top_p": generation_config.get("top_p", 1.0)}
    return replace(params, **{k: v for k, v in defaults.items() if k not in given and v is not None})


def check_sampling(params: SamplingParams) -> None:
    if params.temperature < 0:
        raise UsageError(f"--temperature {params.temperature}: must be 0 (greedy) or more")
    if not 0 < params.top_p <= 1:
        raise UsageError(f"--top-p {params.top_p}: must be in (0, 1]", "1 turns it off")
    if params.top_k < 0:
        raise UsageError(f"--top-k {params.top_k}: must be 0 (off) or more")
    if params.max_tokens < 1:
        raise UsageError(f"--max-tokens {params.max_tokens}: must be at least 1")


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


def run(engine: Engine, printer: TextPrinter | JsonPrinter, seqs: list[Sequence], on_step=None) -> None:
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


def summary(seqs: list[Sequence], elapsed: float, engine: Engine) -> str:
    n = sum(len(s.output_token_ids) for s in seqs)
    rate = n / elapsed if elapsed > 0 else 0.0
    parts = [f"{n} tokens in {elapsed:.2f} s ({rate:.1f} tokens/s)", f"{len(seqs)} prompt{'s' * (len(seqs) != 1)}"]
    if engine.scheduler.num_preemptions:
        n = engine.scheduler.num_preemptions
        parts.append(f"{n} preemption{'s' * (n != 1)}")
    return ", ".join(parts)
