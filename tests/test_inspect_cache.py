"""`pagedcli inspect-cache`: the JSON contract, the moment it shows, its errors, the text table."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from helpers import invoke

PROMPTS = ["Once upon a time", "Tom and his dog", "The sun"]


def inspect(*args):
    return invoke("inspect-cache", *args)


def inspect_json(stories, *args) -> dict:
    code, stdout, stderr = inspect("--model", str(stories), "--raw", "--json", *args)
    assert code == 0, stderr
    return json.loads(stdout)


def check_consistent(d: dict) -> None:
    """What any answer must satisfy, whatever the moment."""
    geo = d["geometry"]
    assert set(d) >= {"slot", "step", "geometry", "free_blocks", "prompt_token_ids", "layers"}
    assert set(geo) >= {"block_size", "block_bytes", "v_offset", "num_blocks"}
    assert geo["block_bytes"] == 2 * geo["v_offset"]
    sequence = d["prompt_token_ids"] + d["output_token_ids"]
    in_cache = sequence[: d["num_cached"]]
    assert [layer["layer"] for layer in d["layers"]] == list(range(geo["num_layers"]))
    seen = []
    for layer in d["layers"]:
        blocks = layer["blocks"]
        assert [b["logical"] for b in blocks] == list(range(len(blocks)))
        for b in blocks:
            assert 0 <= b["physical"] < geo["num_blocks"]
            assert b["k_offset"] == b["physical"] * geo["block_bytes"]
            assert b["v_offset"] == b["k_offset"] + geo["v_offset"]
        # the blocks hold the sequence so far, in order; only the last one may be partial
        assert sum((b["token_ids"] for b in blocks), []) == in_cache
        fills = [len(b["token_ids"]) for b in blocks]
        assert all(f == geo["block_size"] for f in fills[:-1]) and 0 < fills[-1] <= geo["block_size"]
        assert "".join(b["text"] for b in blocks).strip()
        seen += [b["physical"] for b in blocks]
    assert len(seen) == len(set(seen)), "a physical block is used twice across layers"
    assert d["free_blocks"] + d["used_blocks"] == geo["num_blocks"]
    layer0, layer1 = ([b["physical"] for b in d["layers"][i]["blocks"]] for i in (0, 1))
    assert layer0 != layer1


def test_default_moment_is_the_step_before_the_slots_first_request_finishes(stories):
    d = inspect_json(stories, "--max-tokens", "24", "--ignore-eos", "--num-blocks", "120", "--slot", "1", *PROMPTS)
    check_consistent(d)
    # slot 1 holds request 2 first (request 3 reuses slot 0 later); its last step appends token 24
    assert d["slot"] == 1 and d["request"] == {"id": 1, "prompt": PROMPTS[1]}
    assert len(d["output_token_ids"]) == 23
    assert d["num_cached"] == len(d["prompt_token_ids"]) + 22  # the newest token is fed next step
    assert len(d["layers"][0]["blocks"]) == 2  # 29 tokens in 16-token blocks


def test_at_step_shows_whoever_holds_the_slot_after_that_step(stories):
    common = ("--max-tokens", "5", "--ignore-eos", "--batch", "1", "--num-blocks", "40", *PROMPTS[:2])
    first = inspect_json(stories, "--at-step", "1", *common)  # the prefill of request 1
    check_consistent(first)
    assert first["step"] == 1 and first["request"]["id"] == 0
    assert first["num_cached"] == len(first["prompt_token_ids"]) and len(first["output_token_ids"]) == 1
    # request 1 finishes at step 5; step 6 admits request 2 into the same slot
    later = inspect_json(stories, "--at-step", "6", *common)
    check_consistent(later)
    assert later["step"] == 6 and later["request"] == {"id": 1, "prompt": PROMPTS[1]}
    # one slot running: every used block is this slot's, one per layer per logical block
    assert later["used_blocks"] == sum(len(layer["blocks"]) for layer in later["layers"])


@pytest.mark.parametrize("args, message", [
    (["--slot", "2"], "--slot 2 is out of range"),
    (["--slot", "-1"], "--slot -1 is out of range"),
    (["--at-step", "0"], "--at-step 0: must be 1 or more"),
    (["--batch", "3", "--slot", "2"], "--slot 2: no request ran in it (2 requests for slots from 0)"),
    (["--at-step", "99"], "--at-step 99: the run ends by step"),
    (["--batch", "3", "--slot", "2", "--at-step", "3"], "--slot 2 is empty after step 3"),
    (["--layer", "5"], "--layer 5 is out of range"),
])
def test_a_slot_or_step_that_shows_nothing_is_a_usage_error(stories, args, message):
    code, stdout, stderr = inspect("--model", str(stories), "--raw", "--max-tokens", "8", *args,
                                   *PROMPTS[:2])
    assert code == 2 and message in stderr, stderr
    assert stdout == "" and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


def test_text_table_shows_addresses_text_and_how_layers_differ(stories):
    code, stdout, stderr = inspect("--model", str(stories), "--raw", "--max-tokens", "20", "--num-blocks", "60",
                                   "--layer", "2", "--device", "cpu", "One day\nTom went out")  # fp32 sizes
    assert code == 0, stderr
    assert "K address" in stdout and "V address" in stdout and "0x" in stdout
    assert "60 blocks = 245,760 bytes" in stdout and "V at +0x800" in stdout
    assert "layers 0-1, 3-4 hold the same tokens in other physical blocks" in stdout
    assert "day\\nTom" in stdout  # newlines escaped inside the table


def test_capture_with_shuffled_blocks(stories, make_engine):
    """The engine the tests build hands blocks out in a shuffled order."""
    from pagedcli.commands import generate as gen
    from pagedcli.commands import inspect_cache as ic
    from pagedcli.core.options import SamplingParams

    loaded = make_engine(stories, batch=2, num_blocks=80)
    gen.add_requests(loaded.engine, loaded.tokenizer, PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True), False)
    snap, view = ic.capture(loaded.engine, slot=0)
    d = ic.to_json(snap, view, loaded.tokenizer.decode)
    check_consistent(d)
    assert d["request"]["id"] == 0 and len(d["output_token_ids"]) == 29
    assert loaded.engine.has_unfinished  # it stopped stepping once the moment was known


def test_blocks_shared_by_parallel_samples_name_the_other_slots(stories, make_engine):
    from pagedcli.commands import inspect_cache as ic
    from pagedcli.core.options import SamplingParams

    loaded = make_engine(stories, batch=3, num_blocks=100)
    prompt = loaded.tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play outside")
    loaded.engine.add_parallel(prompt, [SamplingParams(temperature=1.0, max_tokens=20, seed=i) for i in range(3)])
    snap, view = ic.capture(loaded.engine, slot=1, at_step=3)
    d = ic.to_json(snap, view, loaded.tokenizer.decode)
    check_consistent(d)
    for layer in d["layers"]:
        first, last = layer["blocks"][0], layer["blocks"][-1]
        assert first["shared_with"] == [0, 2]  # the prompt's full block, one copy for three samples
        assert last["shared_with"] == []  # each sample wrote its own tokens: copied on write
    assert "shared with" in draw_text(ic.render(snap, view, loaded.tokenizer.decode))


def draw_text(renderable) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    return console.file.getvalue()


def test_a_refused_prompt_still_shows_the_slot_but_exits_2(stories):
    """As generate: the other prompts run, the refused one is named, and the exit code says so."""
    code, stdout, stderr = inspect("--model", str(stories), "--raw", "--max-tokens", "8", "--num-blocks", "10",
                                   "Once upon a time", "a " * 60)
    assert code == 2 and "prompt 2:" in stderr and "Traceback" not in stderr
    assert "K address" in stdout


def test_a_step_past_the_end_is_refused_before_running(stories, make_engine):
    """With nothing that could add steps (the pool holds every request at its longest), the last
    step the run can reach is known before it runs; a pool too small to promise that, and the
    run goes to its end first."""
    from pagedcli.commands import inspect_cache as ic
    from pagedcli.core.options import SamplingParams
    from pagedcli.core.errors import UsageError

    loaded = make_engine(stories, batch=2, num_blocks=100)
    seqs = [loaded.engine.add_request(loaded.tokenizer.encode(p), SamplingParams(max_tokens=10, ignore_eos=True), p)
            for p in PROMPTS]
    bound = ic.last_step_at_most(loaded.engine)
    assert bound == sum(len(s.prompt_token_ids) + 9 for s in seqs)
    with pytest.raises(UsageError, match=f"--at-step 1000: the run ends by step {bound} at the latest"):
        ic.capture(loaded.engine, slot=0, at_step=1000)
    assert loaded.engine.num_steps == 0
    while loaded.engine.has_unfinished:  # the bound holds all along, and tightens as the run goes
        loaded.engine.step()
        assert loaded.engine.num_steps <= ic.last_step_at_most(loaded.engine) <= bound
    assert ic.last_step_at_most(make_engine(stories, batch=2, num_blocks=5).engine) is not None  # nothing left
    small = make_engine(stories, batch=2, num_blocks=8)
    for p in PROMPTS:
        small.engine.add_request(small.tokenizer.encode(p), SamplingParams(max_tokens=10, ignore_eos=True), p)
    assert ic.last_step_at_most(small.engine) is None  # preemption could add steps: no promise


def test_a_step_within_the_bound_that_the_run_does_not_reach_names_the_real_last_step(stories, make_engine):
    """Batch mates decode together, so the run ends well before the bound: the refusal then names
    the step it ended after, the same whichever step past it was asked for."""
    from pagedcli.commands import inspect_cache as ic
    from pagedcli.core.options import SamplingParams
    from pagedcli.core.errors import UsageError

    said = set()
    for at_step in (15, 25):
        loaded = make_engine(stories, batch=2, num_blocks=100)
        for p in PROMPTS[:2]:
            loaded.engine.add_request(loaded.tokenizer.encode(p), SamplingParams(max_tokens=10, ignore_eos=True), p)
        assert ic.last_step_at_most(loaded.engine) >= 25
        with pytest.raises(UsageError) as refused:
            ic.capture(loaded.engine, slot=0, at_step=at_step)
        said.add(str(refused.value).split(":")[1])
        assert not loaded.engine.has_unfinished
    # one prefill step for both prompts, then 9 decode steps
    assert said == {" the run ended after step 10 (choose a step from 1 to 10)"}, said
