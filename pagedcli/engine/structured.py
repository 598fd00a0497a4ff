"""Structured outputs: an answer held to a JSON schema, any JSON object, a regex, one of some strings,
or a grammar (GBNF, or Lark as llguidance writes it), through llguidance (the grammar engine
llama.cpp and vLLM use; why this one and not xgrammar: docs/performance.md, "Structured outputs").

A request's constraint (SamplingParams.structured: its kind and its text) becomes a matcher of its
own, which follows the tokens the answer appends. Each step, before sampling, every constrained
row's allowed tokens come from its matcher as a bitmask on the host, go to the device in one copy,
and the disallowed logits become -inf (greedy rows then take their argmax again, sampled rows draw
from what is left, penalties and temperature apply on top, and logprobs stay the raw model's,
vLLM's default). A matcher that has taken a whole answer (nothing more can follow) ends the request
as stop; so does one that cannot go on.

JSON is held without free whitespace (one space after a colon and a comma, no newlines: vLLM's
disable_any_whitespace), so a model fond of newlines still closes its object.

The mask for a step needs the token of the step before it, so a step with a constrained row is not
queued ahead of the host (engine.py's overlap waits for the tokens first, for that step only).
"""

from __future__ import annotations

import json
import re

import torch

from pagedcli.core.errors import UsageError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs:
    """The model's tokenizer as llguidance sees it, and each step's masks. `tokenizer_json`: the
    tokenizers library's JSON of the model's tokenizer; `vocab_size`: the logits' width (a padded
    vocabulary's ids past the tokenizer's are never allowed); `stop_ids`: what ends an answer."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_ids):
        import llguidance

        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self.vocab_size = vocab_size

    def matcher(self, kind: str, text: str):
        """A fresh matcher for one answer; one line naming what is wrong with a constraint that does
        not compile (a schema that is not JSON, an unsupported keyword, a regex or grammar error)."""
        import llguidance

        LL = llguidance.LLMatcher
        try:
            if kind == "json":
                grammar = LL.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
            elif kind == "json_object":
                grammar = LL.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
            elif kind == "regex":
                grammar = LL.grammar_from_regex(text)
            elif kind == "choice":
                grammar = LL.grammar_from_regex("|".join(_escape(c) for c in json.loads(text)))
            else:
                from llguidance.gbnf_to_lark import any_to_lark

                grammar = LL.grammar_from_lark(any_to_lark(text))
            matcher = LL(self.tokenizer, grammar)
        except Exception as e:  # (the converters raise their own errors for a grammar they cannot read)
            self._refuse(kind, str(e) or type(e).__name__)
        if matcher.is_error():
            self._refuse(kind, matcher.get_error())
        return matcher

    @staticmethod
    def _refuse(kind: str, why: str):
        lines = [line.strip() for line in why.strip().splitlines() if line.strip()]
        first = " ".join(lines[:3])[:300]  # (a regex error spreads over lines: where, then what)
        name = kind.replace("_", " ")
        raise UsageError(f"the {name} constraint does not compile: {first}", f"fix the {name}") from None

    def allowed(self, matchers: list, device: torch.device) -> torch.Tensor:
        """[len(matchers), vocab_size] bool: the tokens each matcher allows next, on `device`."""
        # (llguidance's numpy helpers: its torch ones script themselves with torch.jit at import, seconds)
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bitmask = allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, bitmask, i)
        bits = torch.from_numpy(bitmask)
        bits = bits.pin_memory() if device.type == "cuda" else bits
        bits = bits.to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        return ((bits[:, :, None] >> shifts) & 1).bool().view(len(matchers), -1)[:, :self.vocab_size]


def _escape(choice: str) -> str:
    """A choice as a regex matching exactly its text (only the regex's own characters escaped)."""
    return re.sub(r"[\\.^$|?*+()\[\]{}]", lambda m: "\\" + m.group(0), choice)


def advance(seqs) -> list:
    """Feed each constrained sequence's newest appended token to its matcher; the sequences whose
    answer is now whole (nothing more can follow) or that the grammar refuses, to end as stop."""
    done = []
    for seq in seqs:
        matcher = seq.matcher
        if matcher is None or seq.is_finished or seq.matched == len(seq.output_token_ids):
            continue
        ok = matcher.consume_token(seq.output_token_ids[-1])
        seq.matched = len(seq.output_token_ids)
        if not ok or matcher.is_stopped():
            done.append(seq)
    return done
