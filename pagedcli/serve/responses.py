"""OpenAI's response objects, whole (`stream: false`) and as stream chunks, for completions and
chat, built from the deltas the engine hands out (engine_client.Delta)."""

from __future__ import annotations

import json
import random
import time
from json.encoder import encode_basestring as json_string  # a str as JSON, as json.dumps(ensure_ascii=False)

from pagedcli.core.json_lines import one_line
from pagedcli.serve import tools
from pagedcli.serve.engine_client import Delta
from pagedcli.serve.errors import APIError, server_error

LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -inf
COMPACT = (",", ":")  # a chunk a step and stream: no spaces to send
NO_USAGE = object()  # a stream chunk without a usage field


def new_id(prefix: str) -> str:
    """A request's id, as vLLM's (random, 32 hex digits); from `random`, not the system's entropy:
    uuid4 reads os.urandom, a syscall a request, and an id needs to be unique, not unguessable."""
    return f"{prefix}-{random.getrandbits(128):032x}"


def to_json(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=COMPACT)


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: {...}` and a blank line."""
    return f"data: {one_line(data if isinstance(data, str) else to_json(data))}\n\n".encode()


def failure(delta: Delta) -> APIError | None:
    """An answer that did not end on its own (the engine failed, the server stopped) as an error."""
    if delta.finish_reason == "abort":  # the server is shutting down: try again later
        return APIError(delta.error or "the server is shutting down", 503, type="server_error")
    if delta.finish_reason == "error":
        return server_error(delta.error or "the answer ended with an error")
    return None


class Answer:
    """One answer put together from its deltas (for `stream: false`, and the usage count)."""

    def __init__(self):
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[tuple[int, object]] = []  # (token id, TokenLogprobs)
        self.prompt_logprobs: list | None = None  # None, then a TokenLogprobs a prompt token
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        self.logprobs += list(zip(delta.token_ids, delta.logprobs))
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason


class Shapes:
    """The objects of one request: `chat` or completions, its id (the X-Request-Id header's too),
    model and creation time."""

    def __init__(self, chat: bool, request_id: str, model: str, token_text, want_logprobs: bool, token_bytes=None):
        self.chat = chat
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text  # id -> its text, special tokens written out
        # id -> its own bytes (chat's `bytes`: a piece of a character is U+FFFD as text)
        self.token_bytes = token_bytes or (lambda token_id: token_text(token_id).encode())
        self.want_logprobs = want_logprobs
        # vLLM's prompt_logprobs field, a choice's: (each prompt's ids, answers a prompt), when asked for
        self.prompt_logprobs_of: tuple[list[list[int]], int] | None = None
        # completions' echo: (each prompt's ids, its text or None, max_tokens 0: the prompt alone)
        self.echo: tuple[list[list[int]], list[str | None], bool] | None = None
        self.tools: tuple[str, set[str]] | None = None  # chat's tool-call parser and the tools' names
        self.streams: dict[int, tools.CallStream] = {}  # with tools: each answer's calls, read as they come
        self.held: dict[int, Delta] = {}  # with tools: each answer's tokens not yet sent (their logprobs)
        self.offsets: dict[int, int] = {}  # completions' text_offset so far, per answer
        # a stream's chunks differ only in their choice (and usage): the rest is written once
        head = one_line(to_json(self._head("chat.completion.chunk" if chat else "text_completion")))
        self.chunk_start = f"data: {head[:-1]},\"choices\":[".encode()

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # --- log-probabilities ------------------------------------------------------------------------
    def logprobs(self, index: int, entries: list[tuple[int, object]], text: str = "") -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            def one(token_id: int, lp: float) -> dict:
                s = self.token_text(token_id)
                return {"token": s, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(self.token_bytes(token_id))}

            return {"content": [one(t, e.logprob) | {"top_logprobs": [one(i, lp) for i, lp in e.top]}
                                for t, e in entries]}
        tokens = [self.token_text(t) for t, _ in entries]
        offsets, at = [], self.offsets.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self.offsets[index] = at
        # (an echoed prompt's first token has no entry: null, as vLLM gives it)
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else max(e.logprob, LOGPROB_FLOOR) for _, e in entries],
                "top_logprobs": [None if e is None else {self.token_text(i): max(lp, LOGPROB_FLOOR) for i, lp in e.top}
                                 for _, e in entries],
                "text_offset": offsets}

    # --- whole ------------------------------------------------------------------------------------
    def whole(self, answers: list[Answer], usage: dict) -> dict:
        choices = []
        for index, a in enumerate(answers):
            entries, text, finish = a.logprobs, a.text, a.finish_reason
            if self.echo is not None:
                entries, text = self._echoed(index, a, entries, text)
            choice = {"index": index, "logprobs": self.logprobs(index, entries), "finish_reason": finish}
            if self.chat:
                content, calls = tools.parse(text, *self.tools) if self.tools else (text, [])
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [c.to_openai() for c in calls]
                    choice["finish_reason"] = "tool_calls" if finish == "stop" else finish
            else:
                choice["text"] = text
            if self.prompt_logprobs_of is not None:
                ids, n = self.prompt_logprobs_of
                choice["prompt_logprobs"] = self._prompt_logprobs(ids[index // n], a.prompt_logprobs)
            choices.append(choice)
        return self._head("chat.completion" if self.chat else "text_completion") | {"choices": choices, "usage": usage}

    def _echoed(self, index: int, a: Answer, entries: list, text: str) -> tuple[list, str]:
        """Completions' echo: the prompt's text (and, with logprobs, its tokens' entries: the first
        token's null, as vLLM gives them) before the answer's; max_tokens 0: the prompt alone."""
        ids, texts, prompt_only, n = self.echo
        prompt_ids, prompt_text = ids[index // n], texts[index // n]
        if prompt_text is None:  # a prompt of token ids
            prompt_text = "".join(self.token_text(t) for t in prompt_ids)
        if prompt_only:
            entries, text = [], ""
        if self.want_logprobs:
            prompt_entries = a.prompt_logprobs or [None] * len(prompt_ids)
            entries = list(zip(prompt_ids, prompt_entries)) + entries
        return entries, prompt_text + text

    def _prompt_logprobs(self, prompt_ids: list[int], entries: list | None) -> list | None:
        """vLLM's prompt_logprobs: null for the first token, then for each prompt token
        {id: {logprob, rank, decoded_token}}, the token itself and the N likeliest there."""
        if entries is None:
            return None
        out = [None]
        for token, e in zip(prompt_ids[1:], entries[1:]):
            ranked = {str(i): {"logprob": max(lp, LOGPROB_FLOOR), "rank": r, "decoded_token": self.token_text(i)}
                      for r, (i, lp) in enumerate(e.top, start=1)}
            ranked.setdefault(str(token), {"logprob": max(e.logprob, LOGPROB_FLOOR), "rank": e.rank,
                                           "decoded_token": self.token_text(token)})
            out.append(ranked)
        return out

    # --- streamed ---------------------------------------------------------------------------------
    def chunk(self, delta: Delta, first: bool, usage=NO_USAGE) -> bytes | None:
        """One answer's delta as a chunk's server-sent event (a chat answer's first chunk also says
        its role). `usage`: the chunk's usage field, None for OpenAI's null (with include_usage,
        until the last chunk); NO_USAGE: none. Written as text around the values, the JSON of
        the dict {"index", "logprobs", "finish_reason", "delta" or "text"} (a chunk a step and
        stream: json.dumps of the whole took most of this process's own work for a token).
        With tools, a chat answer's chunks come from _tool_chunks (None while it holds back text that
        may begin a call)."""
        if self.tools:
            return self._tool_chunks(delta, first, usage)
        entries = list(zip(delta.token_ids, delta.logprobs))
        if self.echo is not None:
            ids, texts, prompt_only, n = self.echo
            if prompt_only:
                entries, delta = [], Delta(delta.index, [], "", [], delta.finish_reason, delta.error)
            if first:
                answer = Answer()
                answer.prompt_logprobs = delta.prompt_logprobs
                entries, text = self._echoed(delta.index, answer, entries, delta.text)
                delta = Delta(delta.index, delta.token_ids, text, delta.logprobs, delta.finish_reason, delta.error)
        logprobs = to_json(self.logprobs(delta.index, entries)) if entries and self.want_logprobs else "null"
        finish = "null" if delta.finish_reason is None else json_string(delta.finish_reason)
        if self.chat:
            fields = (['"role":"assistant"'] if first else []) + ([f'"content":{json_string(delta.text)}']
                                                                  if delta.text or first else [])
            body = f'"delta":{{{",".join(fields)}}}'
        else:
            body = f'"text":{json_string(delta.text)}'
        tail = "]}" if usage is NO_USAGE else '],"usage":null}' if usage is None else f'],"usage":{to_json(usage)}}}'
        choice = f'{{"index":{delta.index},"logprobs":{logprobs},"finish_reason":{finish},{body}}}{tail}\n\n'
        return self.chunk_start + one_line(choice).encode()

    def _tool_chunks(self, delta: Delta, first: bool, usage) -> bytes | None:
        """A chat answer with tools, streamed as OpenAI streams it (tools.CallStream reads it): text
        as content, held back only where it may begin a call; a call's first chunk with its index,
        id, type, name and arguments "", then chunks of its index and pieces of its arguments; a last
        chunk with finish_reason tool_calls. The log-probabilities of tokens held back go with the
        next chunk. None while everything is held back."""
        stream = self.streams.get(delta.index)
        if stream is None:
            stream = self.streams[delta.index] = tools.CallStream(*self.tools)
        held = self.held.get(delta.index)
        if held is None:
            held = self.held[delta.index] = Delta(delta.index, [], None)  # (its tokens and logprobs: no text)
        held.extend(delta)
        events = stream.feed(delta.text or "")
        if delta.finish_reason is not None:
            events += stream.finish()
            del self.streams[delta.index], self.held[delta.index]
        elif not events:
            return None
        deltas = []
        for event in events:
            if event[0] == "content":
                deltas.append({"content": event[1]})
            elif event[0] == "call":
                call = event[2]
                deltas.append({"tool_calls": [{"index": event[1], "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            else:
                deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        finish = delta.finish_reason
        if finish is not None:
            if stream.calls and finish == "stop":
                finish = "tool_calls"
            if not deltas or stream.calls:  # (OpenAI's last chunk after calls: an empty delta)
                deltas.append({})
        if first:
            deltas[0] = {"role": "assistant", "content": deltas[0].get("content", None if stream.calls else "")} | deltas[0]
        entries = list(zip(held.token_ids, held.logprobs))
        held.token_ids, held.logprobs = [], []
        out = []
        for i, d in enumerate(deltas):
            last = i == len(deltas) - 1
            choice = {"index": delta.index, "logprobs": self.logprobs(delta.index, entries) if i == 0 and entries else None,
                      "finish_reason": finish if last else None, "delta": d}
            body = self._head("chat.completion.chunk") | {"choices": [choice]}
            if usage is not NO_USAGE:
                body["usage"] = usage
            out.append(sse(body))
        return b"".join(out)

    def usage_chunk(self, usage: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {"choices": [], "usage": usage}


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
