"""How answers reach the terminal: streamed text, labelled when there are several prompts, or one
JSON object per prompt. Requests finish in any order; output always comes in input order."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from pagedcli.commands.exits import holds_all_text
from pagedcli.commands.options import with_flags
from pagedcli.core.json_lines import one_line
from pagedcli.engine.sequence import Sequence
from pagedcli.model.tokenizer import StreamDecoder, Tokenizer

ERROR_MARK = " [error]"  # ends the text of an answer that failed (stderr says why); not with --quiet


def answer_text(seq: Sequence, decoder: StreamDecoder, start: int = 0) -> str:
    """The answer's text as far as it may be shown, from character `start` on (what a printer has
    not taken yet: only that is copied, so a step's work does not grow with the answer): with stop
    strings, the engine's cut of it (and while it runs, less a tail that may begin one); else what
    `decoder` makes of its tokens."""
    if seq.stop_strings is not None:
        return seq.stop_strings.text_since(start, seq.is_finished)
    decoder.catch_up(seq.output_token_ids)
    return decoder.text[start:]


class TextPrinter:
    """Streams the answer of the earliest unfinished prompt as it is generated; answers of later
    prompts are held back until every earlier one is printed, so they never interleave. With
    several answers each is labelled `[1]` (`[1.2]`: prompt 1's answer 2), the prompt shown once:
    echoed after the label, or in it when it is not echoed. `labelled` False (--quiet): answers only."""

    def __init__(self, tokenizer: Tokenizer, seqs: list[Sequence], samples: int = 1, echo_prompt: bool = True,
                 out: TextIO | None = None, labelled: bool = True):
        self.seqs = seqs
        self.samples = samples  # answers per prompt: seqs[i * samples + j] is answer j of prompt i
        self.out = out or sys.stdout
        self.echo = echo_prompt
        self.labelled = labelled and len(seqs) > 1
        self.error_mark = ERROR_MARK if labelled else ""  # --quiet: a failed answer's line stays empty
        self.decoders = {s.id: StreamDecoder(tokenizer, s.prompt_token_ids) for s in seqs}
        self.pending = {s.id: "" for s in seqs}  # text not yet printed
        self.taken = {s.id: 0 for s in seqs}  # characters of the answer's text moved to `pending`
        self.current = 0  # index into seqs of the answer being streamed
        self.started = False
        self._advance()

    def update(self, seq: Sequence) -> None:
        """Take in the tokens `seq` gained since the last call."""
        new = answer_text(seq, self.decoders[seq.id], self.taken[seq.id])
        self.pending[seq.id] += new
        self.taken[seq.id] += len(new)

    def flush(self) -> None:
        """Print what can be printed now: the current answer's new text, then every following
        answer that is already finished."""
        self._advance()
        self.out.flush()

    def interrupt(self) -> None:
        """Ctrl-C: end the answer being streamed where it stopped; print no later ones."""
        if self.current < len(self.seqs):
            self.out.write(self.pending[self.seqs[self.current].id] + "\n")
        self.out.flush()

    def _advance(self) -> None:
        while self.current < len(self.seqs):
            seq = self.seqs[self.current]
            if not self.started:
                self._header(seq)
                self.started = True
            self.out.write(self.pending[seq.id])
            self.pending[seq.id] = ""
            if not seq.is_finished:
                return
            self.out.write(self.error_mark * bool(seq.error) + "\n")
            self.current += 1
            self.started = False

    def _header(self, seq: Sequence) -> None:
        if self.labelled:
            prompt, answer = divmod(self.current, self.samples)
            label = f"{prompt + 1}" if self.samples == 1 else f"{prompt + 1}.{answer + 1}"
            echoed = self.echo and seq.prompt is not None
            after = " " if echoed else f" {seq.prompt!r}\n"  # the prompt once: echoed next, or here
            self.out.write(f"{'' if self.current == 0 else chr(10)}[{label}]{after}")
        if self.echo and seq.prompt is not None:
            self.out.write(seq.prompt)


class JsonPrinter:
    """One JSON object per prompt (per answer with --n), one per line, in input order, on stdout
    and nothing else there."""

    def __init__(self, tokenizer: Tokenizer, seqs: list[Sequence], samples: int = 1, out: TextIO | None = None):
        self.tokenizer = tokenizer
        self.seqs = seqs
        self.samples = samples
        self.out = out or sys.stdout
        self.decoders = {s.id: StreamDecoder(tokenizer, s.prompt_token_ids) for s in seqs}
        self.current = 0
        self.holds_all_text = holds_all_text(self.out)

    def update(self, seq: Sequence) -> None:
        if seq.stop_strings is None:
            self.decoders[seq.id].catch_up(seq.output_token_ids)

    def flush(self) -> None:
        while self.current < len(self.seqs) and self.seqs[self.current].is_finished:
            record = self.record(self.seqs[self.current])
            if self.samples > 1:
                record["sample"] = self.current % self.samples
            # (an output encoding that cannot hold every character gets JSON's \u escapes: the same JSON)
            self.out.write(one_line(json.dumps(record, ensure_ascii=not self.holds_all_text)) + "\n")
            self.current += 1
        self.out.flush()

    def interrupt(self) -> None:
        """Ctrl-C: what finished is printed already; unfinished requests print nothing."""
        self.out.flush()

    def record(self, seq: Sequence) -> dict:
        r = {
            "prompt": seq.prompt,
            "prompt_token_ids": seq.prompt_token_ids,
            "token_ids": seq.output_token_ids,
            "text": answer_text(seq, self.decoders[seq.id]),
            "finish_reason": seq.finish_reason,
        }
        if seq.params.logprobs is not None:
            r["logprobs"] = [self._logprobs(t, entry) for t, entry in zip(seq.output_token_ids, seq.logprobs)]
        if seq.params.prompt_logprobs is not None:  # the first prompt token's is null (nothing before it)
            r["prompt_logprobs"] = [None if entry is None else self._logprobs(t, entry)
                                    for t, entry in zip(seq.prompt_token_ids, seq.prompt_logprobs)]
        if seq.error:
            r["error"] = with_flags(seq.error)
        return r

    def _logprobs(self, token: int, entry) -> dict:
        """One token's entry, as vLLM gives it: the chosen token's log-probability and rank, and the
        top ones, each with its id and its own text."""
        def one(token_id: int, logprob: float) -> dict:
            return {"token_id": token_id, "token": self.tokenizer.decode([token_id], skip_special_tokens=False),
                    "logprob": max(logprob, -9999.0)}  # vLLM's floor: JSON has no -inf

        return one(token, entry.logprob) | {"rank": entry.rank, "top_logprobs": [one(i, lp) for i, lp in entry.top]}
