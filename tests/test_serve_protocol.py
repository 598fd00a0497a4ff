"""`pagedcli serve`'s OpenAI-compatible API, through the official `openai` client and plain HTTP:
completions and chat answers (whole and streamed) equal to generate's, the sampling options, the
shape of every response and stream chunk, bad requests as 400s naming the field, the other routes
(models, health, metrics, the cache, 404 and 405), and the request id. The real server
(serve_fixtures.Served) on a free loopback port, the built-in model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import ASSETS  # noqa: E402
from helpers import invoke  # noqa: E402
from serve_fixtures import PROMPTS, TEMPLATE, served, server_fixture  # noqa: E402

server = server_fixture()


def generate_json(*args) -> list[dict]:
    code, out, err = invoke("generate", "--model", "demo", "--device", "cpu", "--json", *args)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


# --- answers ----------------------------------------------------------------------------------
def test_completions_streamed_and_not_are_generates_answers(server):
    records = generate_json("--raw", "--temperature", "0", "--max-tokens", "24", *PROMPTS)
    client = server.client()
    whole = client.completions.create(model="demo", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [r["text"] for r in records]
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == sum(len(r["token_ids"]) for r in records)
    assert whole.usage.prompt_tokens == sum(len(r["prompt_token_ids"]) for r in records)
    for prompt, record in zip(PROMPTS, records):
        pieces, usage, finish = [], None, None
        counted = 0
        for chunk in client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                               stream_options={"include_usage": True, "continuous_usage_stats": True}):
            usage = chunk.usage
            assert usage.completion_tokens >= counted and usage.prompt_tokens == len(record["prompt_token_ids"])
            counted = usage.completion_tokens
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
        assert "".join(pieces) == record["text"]
        assert len(pieces) > 5, "streamed token by token, not in one piece"
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(record["prompt_token_ids"]), len(record["token_ids"]))
        assert finish == record["finish_reason"]
    server.settle()


def test_chat_streamed_and_not_is_generates_chat_answer(server):
    expected = generate_json("--chat", "--chat-template", str(TEMPLATE), "--temperature", "0", "--max-tokens", "20",
                             "Who art thou?")[0]
    client = server.client()
    messages = [{"role": "user", "content": "Who art thou?"}]
    whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected["text"]
    assert whole.choices[0].finish_reason == expected["finish_reason"]
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason == expected["finish_reason"]


def test_sampling_options_seeds_n_stop_and_logprobs_are_generates(server):
    client = server.client()
    expected = generate_json("--raw", "--temperature", "0.9", "--top-k", "40", "--seed", "5", "--n", "2",
                             "--max-tokens", "16", "--frequency-penalty", "0.5", "ROMEO:")
    got = client.completions.create(model="demo", prompt="ROMEO:", temperature=0.9, seed=5, n=2, max_tokens=16,
                                    frequency_penalty=0.5, extra_body={"top_k": 40})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [r["text"] for r in expected]
    stopped = client.completions.create(model="demo", prompt="ROMEO:", temperature=0, max_tokens=40, stop=["\n\n"])
    assert stopped.choices[0].finish_reason == "stop" and "\n\n" not in stopped.choices[0].text
    assert stopped.choices[0].text == generate_json("--raw", "--temperature", "0", "--max-tokens", "40", "--stop",
                                                    "\n\n", "ROMEO:")[0]["text"]
    lp = client.completions.create(model="demo", prompt="ROMEO:", temperature=0, max_tokens=6, logprobs=3)
    entries = lp.choices[0].logprobs
    assert len(entries.tokens) == 6 and len(entries.token_logprobs) == 6
    assert all(len(top) == 3 and max(top.values()) <= 0 for top in entries.top_logprobs)
    assert entries.text_offset == [sum(len(t) for t in entries.tokens[:i]) for i in range(6)]
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    server.settle()


def test_a_stream_that_fails_past_its_first_byte_ends_with_an_error_event(server, monkeypatch):
    """A bug while a stream runs (its 200 sent): an error event and [DONE], not a cut connection;
    its job is aborted and the others go on."""
    from pagedcli.serve.responses import Shapes

    real, calls = Shapes.chunk, []

    def chunk(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in a chunk")
        return real(self, *args)

    monkeypatch.setattr(Shapes, "chunk", chunk)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                      json={"model": "demo", "prompt": "KING", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]", events[-3:]
    assert "the stream failed: RuntimeError: a bug in a chunk" in events[-2] and len(events) == 4
    monkeypatch.undo()
    server.settle()  # aborted: every block back
    again = server.client().completions.create(model="demo", prompt="KING", max_tokens=5, temperature=0)
    assert again.usage.completion_tokens == 5


@pytest.mark.parametrize("model", ["demo", "stories"])
def test_decoding_several_tokens_at_once_gives_the_same_text(model, stories):
    """A client that fell behind gets its tokens in one piece (StreamDecoder.catch_up_at_once):
    the text is the one decoded token by token, whatever the pieces."""
    import random

    from pagedcli.model.source import DEMO_FOLDER
    from pagedcli.model.tokenizer import StreamDecoder, Tokenizer

    tokenizer = Tokenizer(DEMO_FOLDER if model == "demo" else stories)
    rng = random.Random(3)
    for _ in range(20):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        one_by_one = StreamDecoder(tokenizer, prompt)
        one_by_one.catch_up(output)
        at_once, cut = StreamDecoder(tokenizer, prompt), 0
        while cut < len(output):
            cut += rng.randrange(1, 6)
            at_once.catch_up_at_once(output[:cut])
        assert at_once.text == one_by_one.text


# --- bad requests -----------------------------------------------------------------------------
LONG = list(range(5, 605))  # 600 token ids: more than the demo model's 512 positions


BAD = [
    (b'{"prompt": "ROMEO:", "max_tokens": 5', None, "not valid JSON"),
    (b'["ROMEO:"]', None, "must be a JSON object"),
    (b'{"max_tokens": 5}', "prompt", "`prompt` is required"),
    (b'{"prompt": "ROMEO:", "max_tokens": "5"}', "max_tokens", "`max_tokens`: \"5\" should be a valid integer"),
    (b'{"prompt": "ROMEO:", "temperature": true}', "temperature", "should be a valid number"),
    (b'{"prompt": 17}', "prompt", "`prompt`: 17 is not one of the types it takes"),
    (b'{"prompt": "ROMEO:", "max_tokens": 600}', "max_tokens", "maximum length is 512 tokens"),
    (json.dumps({"prompt": LONG}).encode(), "prompt", "the prompt has 600 tokens"),
    (b'{"prompt": [5, 99999]}', "prompt", "token id 99999 is outside the model's vocabulary"),
    (b'{"prompt": []}', "prompt", "`prompt` is an empty list"),
    (b'{"prompt": "ROMEO:", "temperature": -1}', "temperature", "`temperature` -1.0: must be 0"),
    (b'{"prompt": "ROMEO:", "top_p": 1.5}', "top_p", "`top_p` 1.5: must be in (0, 1]"),
    (b'{"prompt": "ROMEO:", "logprobs": 50}', "logprobs", "`logprobs` 50: must be from 0 to 20"),
    (b'{"prompt": "ROMEO:", "n": 0}', "n", "`n` 0"),
    (b'{"prompt": "ROMEO:", "stop": [""]}', "stop", "must not be empty"),
    (b'{"prompt": "ROMEO:", "presence_penalty": 3}', "presence_penalty", "must be in [-2, 2]"),
    # OpenAI's fields this server does not do: said, not ignored
    (b'{"prompt": "ROMEO:", "best_of": 3}', "best_of", "`best_of` 3: not supported"),
    (b'{"prompt": "ROMEO:", "suffix": "x"}', "suffix", "`suffix`"),
    (b'{"prompt": "ROMEO:", "stream_options": {"include_usage": true}}', "stream_options",
     "`stream_options` is for a streamed answer"),  # (vLLM's 400: no stream, nothing would read them)
    # bodies that were 500s with a traceback: a lone surrogate (the tokenizer's TypeError), nesting past
    # Python's recursion limit, a number past its 4,300 digits (json's ValueError)
    (b'{"prompt": ["ok", "a\\ud800"]}', "prompt[1]", "`prompt[1]` is not valid Unicode text (a lone surrogate U+D800"),
    (b'{"prompt": "ROMEO:", "\\udfff": 1}', None, "a key of the body is not valid Unicode text"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nests arrays or objects too deeply"),
    (b'{"prompt": [' + b"9" * 5000 + b"]}", None, "a number with thousands of digits"),
    # one prompt of several at fault: it is named (it was `prompt`, whichever of a thousand it was)
    (b'{"prompt": [[1, 2], []]}', "prompt[1]", "`prompt[1]`: the prompt is empty"),
    (b'{"prompt": ["ok", "' + b"word " * 600 + b'"]}', "prompt[1]", "`prompt[1]`: the prompt has"),
    (b'{"prompt": [[1], [2], [5000]]}', "prompt[2]", "`prompt[2]`: token id 5000 is outside"),
    # one that made a NaN distribution: the draw's error failed the whole step, its batch mates too
    (b'{"prompt": "ROMEO:", "temperature": 1, "repetition_penalty": 1e-300}', "repetition_penalty",
     "`repetition_penalty` 1e-300: must be a positive number from 0.0001 to 10000"),
]


@pytest.mark.parametrize("body, param, fragment", BAD, ids=[f[2][:30] for f in BAD])
def test_a_bad_completion_request_is_a_400_naming_the_field(server, body, param, fragment):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and fragment in error["message"], error


def test_a_field_given_as_null_takes_its_default_as_openais_api_reads_it(server):
    """OpenAI's API takes null for every optional field (clients that fill in every field send
    them): `"n": null` is one answer, `"stream": null` no stream; they were 400s."""
    nulls = {"n": None, "stream": None, "stream_options": None, "logprobs": None, "echo": None, "stop": None,
             "max_tokens": None, "temperature": None}
    body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=nulls | body)
    assert r.status_code == 200, r.text
    expected = httpx.post(server.url + "/v1/completions", json=body).json()["choices"]
    assert r.json()["choices"] == expected and len(expected) == 1
    chat = {"model": "demo", "max_tokens": 2, "n": None, "stream": None, "logprobs": None, "top_logprobs": None,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "demo", "prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_bad_chat_requests_and_other_requests_unharmed(server):
    client = server.client()
    running = client.completions.create(model="demo", prompt="KING", max_tokens=80, temperature=0, stream=True)
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]},
                                                         "messages[0].role"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs")]:
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "demo"} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x", max_tokens=10_000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    expected = client.completions.create(model="demo", prompt="KING", max_tokens=80, temperature=0).choices[0].text
    assert "".join(c.choices[0].text for c in running) == expected
    server.settle()


def test_a_chat_template_that_refuses_the_messages_is_a_400_with_a_clients_way_out(server, monkeypatch):
    """A template's raise_exception (roles must alternate, as many models' do) is the client's
    400, with a way out for a client (it said generate's hint: "use `raw` to feed the prompt")."""
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}"
                "{% endif %}{{ messages[0]['content'] }}")
    monkeypatch.setattr(server.ready.tokenizer, "chat_template", template)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "demo", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    message = r.json()["error"]["message"]
    assert "the first message must be the user" in message and "/v1/completions" in message and "raw" not in message
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_in_a_chat_message_is_a_400_and_an_escaped_emoji_is_text(server):
    def chat(body: dict) -> httpx.Response:  # json.dumps writes non-ASCII as escapes: 😀 as \ud83d\ude00
        return httpx.post(server.url + "/v1/chat/completions", content=json.dumps(body))

    for content in ["\ud800", [{"type": "text", "text": "x\udfff"}]]:
        r = chat({"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].startswith("messages[0].content") and "U+D" in r.json()["error"]["message"]
    assert chat({"messages": [{"role": "user", "content": "😀"}], "max_tokens": 2}).status_code == 200


# --- what the server shows --------------------------------------------------------------------
def test_metrics_parse_and_count_what_ran(server):
    from prometheus_client.parser import text_string_to_metric_families

    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}

    before = families()
    got = server.client().completions.create(model="demo", prompt=PROMPTS[:2], max_tokens=10, temperature=0)
    server.settle()
    after = families()

    def value(fams, name, sample=None) -> float:
        return next(s.value for s in fams[name].samples if s.name == (sample or name))

    for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:num_preemptions", "counter"),
                       ("vllm:generation_tokens", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"), ("pagedcli:kv_blocks_free", "gauge"),
                       ("pagedcli:prefix_cache_hit_rate", "gauge"), ("vllm:prefix_cache_hits", "counter")]:
        assert after[name].type == kind, name
    tokens = "vllm:generation_tokens_total"
    assert value(after, "vllm:generation_tokens", tokens) - value(before, "vllm:generation_tokens", tokens) \
        == got.usage.completion_tokens
    ttft = "vllm:time_to_first_token_seconds_count"
    assert value(after, "vllm:time_to_first_token_seconds", ttft) - value(before, "vllm:time_to_first_token_seconds",
                                                                          ttft) == 2
    itl = "vllm:inter_token_latency_seconds_count"  # one a token after each answer's first
    assert value(after, "vllm:inter_token_latency_seconds", itl) - value(before, "vllm:inter_token_latency_seconds",
                                                                         itl) == got.usage.completion_tokens - 2
    assert value(after, "pagedcli:kv_blocks_free") == server.ready.geometry.num_blocks
    assert value(after, "vllm:num_requests_running") == 0


def test_the_cache_endpoint_shows_inspect_caches_fields_per_running_request(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"X-Request-Id": "watch-me"},
                      json={"prompt": PROMPTS[2], "max_tokens": 300, "stream": True, "ignore_eos": True}) as r:
        assert r.headers["x-request-id"] == "watch-me"
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        cache = httpx.get(server.url + "/v1/cache").json()
    running = cache["running"]
    assert [entry["request_id"] for entry in running] == ["watch-me"]
    entry = running[0]
    assert set(entry) == {"request_id", "slot", "step", "geometry", "free_blocks", "used_blocks", "request",
                          "prompt_token_ids", "output_token_ids", "num_cached", "prefill", "layers",
                          "sliding_window", "released_blocks", "weights", "ranks"}
    assert entry["weights"] == "float32"  # the demo model's, as inspect-cache names it
    assert entry["ranks"] == [] and cache["ranks"] == []  # one device (tensor parallelism lists its ranks)
    assert entry["request"]["prompt"] == PROMPTS[2] and entry["output_token_ids"]
    assert entry["prompt_token_ids"] == server.ready.tokenizer.encode(PROMPTS[2])
    geo = server.ready.geometry
    layers = entry["layers"]
    assert len(layers) == geo.num_layers
    assert all(len(layer["blocks"]) >= -(-entry["num_cached"] // geo.block_size) for layer in layers)
    assert cache["used_blocks"] == sum(len(layer["blocks"]) for layer in layers), "its blocks are all in use"
    assert layers[0]["blocks"][0]["k_offset"] == layers[0]["blocks"][0]["physical"] * geo.block_bytes
    server.settle()


def test_random_weights_are_served_for_token_id_prompts(tiny):
    """A benchmark through the server with random weights (no tokenizer): token ids in, usage out."""
    with served(batch=4, model=f"random:{tiny}") as s:
        client = s.client()
        got = client.completions.create(model=f"random:{tiny}", prompt=[[5, 6, 7], [8, 9]], max_tokens=7,
                                        extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 14 and [c.text for c in got.choices] == ["", ""]
        chunks = list(client.completions.create(model=f"random:{tiny}", prompt=[5, 6, 7], max_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True, "continuous_usage_stats": True}))
        assert chunks[-1].usage.completion_tokens == 5
        for prompt, param in [("a text", "prompt"), ([5, 6], "stop")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=f"random:{tiny}", prompt=prompt, max_tokens=3, stop=["x"])
            assert e.value.body["param"] == param
        assert httpx.get(s.url + "/v1/cache").json()["running"] == []
        s.settle()


def test_models_and_health(server):
    models = server.client().models.list().data
    assert [(m.id, m.owned_by) for m in models] == [("demo", "pagedcli")]
    assert server.client().models.retrieve("demo") == models[0]  # OpenAI's GET /v1/models/{model} (was a 404)
    with pytest.raises(openai.NotFoundError) as e:
        server.client().models.retrieve("org/other")
    assert e.value.body["code"] == "model_not_found" and "'org/other'" in e.value.body["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    # HEAD where GET is (HTTP asks it of every server; monitors probe with it): it was a 405
    for path in ("/health", "/v1/models", "/metrics"):
        r = httpx.head(server.url + path)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_other_methods_on_the_post_routes_are_405_saying_allow_post(server):
    for route in ("/v1/completions", "/v1/chat/completions"):
        for method in ("GET", "HEAD", "PUT"):
            r = httpx.request(method, server.url + route)
            assert r.status_code == 405 and r.headers.get("allow") == "POST", (route, method, r.headers)
            assert method == "HEAD" or r.json()["error"]["message"] == f"{method} {route}: not allowed here (it takes POST)"


def test_the_answers_id_is_the_request_id_header(server):
    """One id a request: the body's `id` is the X-Request-Id header, given or made."""
    body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 2}
    given = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Request-Id": "mine-1"})
    assert given.headers["x-request-id"] == "mine-1" and given.json()["id"] == "mine-1"
    made = httpx.post(server.url + "/v1/completions", json=body)
    assert made.json()["id"] == made.headers["x-request-id"] and made.json()["id"].startswith("cmpl")


# --- the shapes of the answers ----------------------------------------------------------------
def test_chat_logprobs_bytes_are_each_tokens_own_bytes():
    """A piece of a character (stories260K's byte fallback: 😀 is four `<0xNN>` pieces) is U+FFFD as
    text; its `bytes` are its own byte, so a client joins the pieces into the character."""
    from pagedcli.model.tokenizer import Tokenizer
    from pagedcli.serve.responses import Shapes

    class Logprob:
        def __init__(self, logprob, top):
            self.logprob, self.top = logprob, top

    tok = Tokenizer(ASSETS / "stories260K")
    pieces = tok.tok.encode("\U0001F600", add_special_tokens=False).ids[-4:]
    shapes = Shapes(True, "chatcmpl-1", "stories", lambda t: tok.decode([t], skip_special_tokens=False), True,
                    tok.token_bytes)
    content = shapes.logprobs(0, [(t, Logprob(-1.0, [(t, -1.0)])) for t in pieces])["content"]
    assert [e["token"] for e in content] == ["\ufffd"] * 4
    assert bytes(b for e in content for b in e["bytes"]).decode() == "\U0001F600"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_chunk_is_the_json_of_openais_chunk_object(chat):
    """Shapes.chunk writes its JSON by hand: it must parse to OpenAI's chunk, text with quotes,
    newlines and non-ASCII, a finish reason, log-probabilities and each kind of usage field."""
    from pagedcli.serve.engine_client import Delta
    from pagedcli.serve.responses import NO_USAGE, Shapes

    class Logprob:
        def __init__(self, logprob, top):
            self.logprob, self.top = logprob, top

    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "cmpl-1", "object": kind, "model": 'a "model"\u2028é'}
    token_text = lambda t: f"<{t}\u2029>"  # noqa: E731
    for want_logprobs in (False, True):
        shapes = Shapes(chat, "cmpl-1", head["model"], token_text, want_logprobs)
        twin = Shapes(chat, "cmpl-1", head["model"], token_text, want_logprobs)  # (offsets: its own)
        for first, text, finish, usage in ((True, 'say "hi"\n\u00e9\u2028\x85\u2029', None, NO_USAGE),
                                           (False, "", "stop", None),
                                           (False, "x", "length", {"prompt_tokens": 2, "completion_tokens": 3,
                                                                   "total_tokens": 5})):
            delta = Delta(1, [7, 8], text, [Logprob(-0.5, [(7, -0.5)]), Logprob(float("-inf"), [(9, -1.0)])], finish)
            event = shapes.chunk(delta, first, usage)
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            assert event.decode().splitlines() == [event.decode()[:-2], ""]  # one line, for a client that splits so
            got = json.loads(event[6:])
            logprobs = twin.logprobs(1, list(zip(delta.token_ids, delta.logprobs))) if want_logprobs else None
            choice = {"index": 1, "finish_reason": finish, "logprobs": logprobs}
            if chat:
                role = {"role": "assistant"} if first else {}
                choice["delta"] = role | ({"content": text} if text or first else {})
            else:
                choice["text"] = text
            want = head | {"created": shapes.created, "choices": [choice]}
            if usage is not NO_USAGE:
                want["usage"] = usage
            assert got == want
