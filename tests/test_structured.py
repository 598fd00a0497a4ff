"""Structured outputs (engine/structured.py, through xgrammar) and prompt log-probabilities, in the
engine and the command line: an answer held to a JSON schema always parses and validates, for
greedy, sampled and parallel samples, beside free answers, with penalties, logprobs, prefix-cache
hits, chunked prefill and preemption; regexes, choices and grammars hold; a constraint that does not
compile is one line. Prompt log-probabilities equal transformers' log-softmax of the same prompt."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from helpers import check_block_accounting, invoke
from pagedcli.core.errors import UsageError
from pagedcli.core.options import SamplingParams

# the built-in model writes Shakespeare: its free text is never JSON, so a parse proves the grammar
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "mood", "lines"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["merry", "sad"]},
                         "lines": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 2}}}


def valid(text: str) -> bool:
    """Whether `text` is an object SCHEMA accepts (checked by hand: the schema is small)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "mood", "lines"}
            and isinstance(value["name"], str) and len(value["name"]) <= 20
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120 and value["mood"] in ("merry", "sad")
            and isinstance(value["lines"], list) and len(value["lines"]) <= 2
            and all(isinstance(x, str) and len(x) <= 24 for x in value["lines"]))


def run(engine, requests) -> list:
    """requests: (prompt ids, params, n); the sequences, all run together, blocks checked each step
    (the i-th of n samples with seed + i, as generate gives them)."""
    seqs = []
    for ids, params, n in requests:
        samples = [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]
        seqs += engine.add_parallel(ids, samples) if n > 1 else [engine.add_request(ids, params)]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    return seqs


@pytest.fixture(scope="module")
def demo():
    from pagedcli.core.options import EngineOptions
    from pagedcli.engine.build import load

    return load(EngineOptions(model="demo", device="cpu", batch=4, max_num_batched_tokens=8))


def test_a_json_schema_holds_for_greedy_sampled_and_parallel_answers_beside_free_ones(demo):
    engine, tok = demo.engine, demo.tokenizer
    held = ("json", json.dumps(SCHEMA))
    prompt = tok.encode("ROMEO: Tell me of Juliet, and of the night.")
    requests = [(prompt, SamplingParams(max_tokens=160, structured=held), 1),
                (prompt, SamplingParams(max_tokens=160, temperature=1.0, seed=3, structured=held,
                                        repetition_penalty=1.3, logprobs=2), 4),
                (prompt, SamplingParams(max_tokens=40, temperature=0.8, seed=1), 1)]  # free, beside them
    seqs = run(engine, requests)
    for seq in seqs[:5]:
        text = tok.decode(seq.output_token_ids)
        assert valid(text) and seq.finish_reason == "stop", text
    assert len({tok.decode(s.output_token_ids) for s in seqs[1:5]}) > 1  # the samples differ
    assert len(seqs[1].logprobs) == len(seqs[1].output_token_ids)
    assert not valid(tok.decode(seqs[5].output_token_ids))  # the free answer is not held
    again = run(engine, requests[:1])[0]  # a cached prefix (prefix caching is on), the same greedy answer
    assert again.output_token_ids == seqs[0].output_token_ids


def test_a_grammar_holds_under_preemption(demo, make_engine):
    """A pool so small that sequences are preempted and recomputed: the recomputed ones keep their
    matcher's state, and every answer still parses."""
    loaded = make_engine("demo", num_blocks=5 * 14, batch=4, max_num_batched_tokens=8)
    prompt = demo.tokenizer.encode("JULIET: O Romeo, Romeo! wherefore art thou Romeo?")
    params = SamplingParams(max_tokens=160, temperature=0.9, seed=7, structured=("json", json.dumps(SCHEMA)))
    seqs = run(loaded.engine, [(prompt, params, 4)])
    assert loaded.engine.scheduler.num_preemptions > 0
    assert all(valid(demo.tokenizer.decode(s.output_token_ids)) for s in seqs)


# (bounded: a model of Shakespeare would fill an unbounded [a-z]+ or a free JSON string to max_tokens)
@pytest.mark.parametrize("kind, text, pattern, temperature", [
    ("regex", r"[A-Z][a-z]{1,9} of [A-Z][a-z]{1,9}", r"[A-Z][a-z]{1,9} of [A-Z][a-z]{1,9}", 1.0),
    ("choice", json.dumps(["Montague", "Capulet", "Verona?"]), r"Montague|Capulet|Verona\?", 1.0),
    ("grammar", 'root ::= "Act " [1-5] ", scene " [1-9]', r"Act [1-5], scene [1-9]", 1.0),
    ("json_object", "", r"\{.*\}", 0.0),
])
def test_regex_choice_grammar_and_any_object_hold(demo, kind, text, pattern, temperature):
    tok = demo.tokenizer
    seqs = run(demo.engine, [(tok.encode("ROMEO:"), SamplingParams(max_tokens=80, temperature=temperature, seed=s,
                                                                   structured=(kind, text)), 1) for s in range(3)])
    for seq in seqs:
        answer = tok.decode(seq.output_token_ids)
        assert re.fullmatch(pattern, answer, re.S) and seq.finish_reason == "stop", answer
        if kind == "json_object":
            assert isinstance(json.loads(answer), dict)


@pytest.mark.parametrize("structured, message", [
    (("json", "{not json"), "json constraint does not compile"),
    (("regex", "(unclosed"), "regex constraint does not compile"),
    (("grammar", "root ::= missing_rule"), "grammar constraint does not compile"),
])
def test_a_constraint_that_does_not_compile_is_one_line(demo, structured, message):
    before = len(demo.engine.sequences)
    with pytest.raises(UsageError, match=message) as e:
        demo.engine.add_request([1, 2, 3], SamplingParams(structured=structured))
    assert "\n" not in e.value.message and len(demo.engine.sequences) == before  # nothing was added


def test_generate_takes_a_json_schema_file_a_regex_and_choices(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code, out, err = invoke("generate", "--json-schema", str(schema), "--n", "2", "--temperature", "0.9", "--seed", "4",
                            "--max-tokens", "160", "--json", "ROMEO:")
    assert code == 0, err
    assert all(valid(json.loads(line)["text"]) for line in out.splitlines())
    code, out, _ = invoke("generate", "--choice", "aye", "--choice", "nay", "-q", "Wilt thou?")
    assert code == 0 and out.strip() in ("aye", "nay")
    code, _, err = invoke("generate", "--regex", "a", "--choice", "b", "x")
    assert code == 2 and "--regex and --choice both constrain the answer" in err
    code, _, err = invoke("generate", "--json-schema", str(tmp_path / "none.json"), "x")
    assert code == 2 and "none.json" in err


def test_prompt_logprobs_equal_transformers_log_softmax(stories, make_engine):
    """Each prompt token's log-probability (the first's null) and its rank, within 1e-4 of
    transformers' float32 log-softmax, with the prompt whole, in chunks of 5, and when its prefix is
    cached by an earlier request (a request for prompt log-probabilities computes its whole prompt)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32).eval()
    prompts = [[1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401], [1, 403]]
    for opts in (dict(chunked_prefill=False), dict(max_num_batched_tokens=5)):
        engine = make_engine(stories, batch=3, **opts).engine
        run(engine, [(prompts[0], SamplingParams(max_tokens=2), 1)])  # its blocks now in the prefix cache
        seqs = run(engine, [(p, SamplingParams(max_tokens=2, prompt_logprobs=3), 1) for p in prompts])
        for prompt, seq in zip(prompts, seqs):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
            assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(prompt)
            for i in range(1, len(prompt)):
                entry, want = seq.prompt_logprobs[i], ref[i - 1]
                assert abs(entry.logprob - want[prompt[i]].item()) < 1e-4
                assert entry.rank == int((want >= want[prompt[i]]).sum())
                assert [t for t, _ in entry.top] == want.topk(3).indices.tolist()


def test_generate_json_has_prompt_logprobs(stories):
    code, out, err = invoke("generate", "--model", str(stories), "--raw", "--json", "--prompt-logprobs", "1",
                            "--max-tokens", "2", "--temperature", "0", "Once upon a time")
    assert code == 0, err
    record = json.loads(out)
    entries = record["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(record["prompt_token_ids"])
    assert [e["token_id"] for e in entries[1:]] == record["prompt_token_ids"][1:]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 1 for e in entries[1:])


def test_bench_times_a_constrained_run(tmp_path):
    """bench --json-schema: every answer held to the schema (the figures of a constrained step, to set
    beside a free run's); refused up front for random weights, which have no text."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code, out, err = invoke("bench", "--model", "demo", "--batch", "2", "--input-len", "8", "--output-len", "24",
                            "--json-schema", str(schema), "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["decode_tokens_per_s"] > 0
    code, _, err = invoke("bench", "--model", "random:smollm2-135m", "--json-schema", str(schema))
    assert code == 2 and "has no tokenizer" in err
