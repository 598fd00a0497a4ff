"""Text <-> token ids with the model's own tokenizer.json, its chat template rendered the way
transformers renders it (jinja2, sandboxed), and incremental detokenization for streaming."""

from __future__ import annotations

import json
import re
import signal
import threading
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pagedcli.core.errors import RunError, UsageError
from pagedcli.model.config_checks import check_chat_template, check_tokenizer_config
from pagedcli.model.files import read_given_text, read_json, read_text

# A chat template is a program from the model folder: its render is stopped past these (the
# templates of real models render a prompt in milliseconds, and add a few hundred characters)
RENDER_SECONDS = 5.0
RENDER_MAX_CHARS = 1 << 20  # beyond the prompt's own length


class Tokenizer:
    def __init__(self, folder: Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise UsageError(f"no tokenizer.json in {folder}", "the model folder needs the tokenizer its checkpoint came with")
        text = read_text(path)
        try:
            self.tok = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise RunError(f"{path} could not be read ({_first_line(e)})") from None
        config = read_json(folder / "tokenizer_config.json")
        check_tokenizer_config(config, str(folder / "tokenizer_config.json"))
        self._setup(_token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
                    bool(config.get("add_bos_token", False)), config.get("chat_template") or _read_template(folder))

    @classmethod
    def from_tokenizer(cls, tok: HFTokenizer, bos_token: str | None, eos_token: str | None, add_bos: bool,
                       chat_template: str | None) -> Tokenizer:
        """A tokenizer built in memory (a GGUF file's vocabulary: model/gguf_tokenizer.py) with the
        special tokens and chat template a folder's tokenizer_config.json would give."""
        self = cls.__new__(cls)
        self.tok = tok
        self._setup(bos_token, eos_token, add_bos, chat_template)
        return self

    def _setup(self, bos_token: str | None, eos_token: str | None, add_bos: bool, chat_template) -> None:
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos
        self.chat_template = chat_template
        self.template_source = "the model's chat template"  # as messages name it
        # variables every render passes the template beside the messages (vLLM's chat_template_kwargs,
        # e.g. Qwen3's enable_thinking); a request may add its own
        self.template_kwargs: dict = {}
        if isinstance(self.chat_template, list):  # several named templates: take the default one
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.vocab_size = self.tok.get_vocab_size()
        decoder = self.tok.decoder  # (its JSON alone: the whole file's is 9 MB for Llama 3)
        self._byte_level = decoder is not None and _is_byte_level(json.loads(decoder.__getstate__()))
        # added tokens are written as they are, not byte-encoded
        self._added = {i: t.content for i, t in self.tok.get_added_tokens_decoder().items()}
        self._bytes: dict[int, bytes] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def token_id(self, text: str | None) -> int | None:
        return self.tok.token_to_id(text) if text else None

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """`chat`: wrap the prompt as one user message (after a `system` one, if given) in the model's
        chat template; otherwise feed it as is, with BOS where the tokenizer's post-processor (or
        add_bos_token) puts one."""
        if chat:
            return self.encode_rendered(self.render_chat(chat_messages(prompt, system)))
        ids = self.tok.encode_batch([prompt])[0].ids  # a batch of one: encode_batch lets go of the GIL (serve)
        bos = self.token_id(self.bos_token)
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """Text the chat template rendered: its special tokens are written out, none is added."""
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def use_chat_template(self, path: Path) -> None:
        """Take the Jinja template in `path` (`chat_template`) instead of the model folder's; a
        file that is not a template is refused here, before anything is rendered with it."""
        from jinja2 import TemplateSyntaxError

        what = f"`chat_template` {path}"
        text = read_given_text(path, what, "give a Jinja file, e.g. chat_template.jinja")
        check_chat_template(text, str(path))
        if not text.strip():
            raise UsageError(f"{what}: the file is empty", "give a Jinja chat template")
        try:
            _environment().parse(text)
        except TemplateSyntaxError as e:
            raise UsageError(f"{what}: not a Jinja template (line {e.lineno}: {_first_line(e)})",
                             "see the chat_template.jinja of a model on the Hub for the form") from None
        self.chat_template = text
        self.template_source = f"the chat template {path}"

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    variables: dict | None = None) -> str:
        """The chat template rendered for `messages` ({"role": ..., "content": ...} each, as
        transformers' apply_chat_template takes them), ending with the assistant's header.
        `variables` (over `template_kwargs`): more for the template, as apply_chat_template passes
        its extra arguments (Qwen3's enable_thinking); they cannot replace the four above."""
        from jinja2 import TemplateError

        def failed(why: str):
            return RunError(f"{self.template_source} failed: {why}", "use `raw` to feed the prompt as is")

        env = _environment()
        limit = sum(len(m["content"]) for m in messages) + RENDER_MAX_CHARS
        pieces, size = [], 0
        try:
            with _time_limit(RENDER_SECONDS):
                variables = self.template_kwargs | (variables or {}) | dict(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                )
                for piece in env.from_string(self.chat_template).generate(**variables):
                    pieces.append(piece)
                    size += len(piece)
                    if size > limit:
                        raise failed(f"it rendered more than {limit} characters")
        except TemplateError as e:
            raise failed(_first_line(e)) from None
        except _RenderTimeout:
            raise failed(f"it ran for more than {RENDER_SECONDS:g} s") from None
        except RecursionError:
            raise failed("it recurses too deeply") from None
        except MemoryError:
            raise failed("it ran out of memory") from None
        except RunError:
            raise
        except Exception as e:  # the template is a program from the model folder: any error is its own
            raise failed(f"{type(e).__name__}: {_first_line(e)}") from None
        return "".join(pieces)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, as OpenAI's log-probabilities give them (`bytes`: what joins a
        character's pieces back together, where each piece's text alone is U+FFFD): a byte-level
        piece's bytes through GPT-2's byte-to-character table, a byte-fallback piece's one byte
        (`<0xF0>`), SentencePiece's `▁` as the space it stands for; an added (special) token's text."""
        found = self._bytes.get(token_id)
        if found is None:
            piece = self.tok.id_to_token(token_id) or ""
            if token_id in self._added:
                found = self._added[token_id].encode()
            elif self._byte_level and all(c in BYTE_OF_CHAR for c in piece):
                found = bytes(BYTE_OF_CHAR[c] for c in piece)
            elif m := BYTE_PIECE.fullmatch(piece):
                found = bytes([int(m.group(1), 16)])
            else:
                found = piece.replace("\u2581", " ").encode()
            self._bytes[token_id] = found
        return found


    def to_json(self) -> str:
        """The tokenizer as the tokenizers library writes it (for llguidance: engine/structured.py)."""
        return self.tok.to_str()


class StreamDecoder:
    """The text of generated tokens, piece by piece, never splitting a multi-byte character
    (vLLM's prefix/read offsets: only a short window is decoded each time). The last prompt tokens
    seed the window, so the first piece keeps its leading space."""

    CONTEXT = 5  # prompt tokens decoded as context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.decode = tokenizer.decode
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_seen = 0  # output tokens taken in

    def catch_up(self, output_ids: list[int]) -> str:
        """Push the output tokens not seen yet; returns the new text."""
        if len(output_ids) == self.num_seen + 1:  # a step's token: the common case, in a server once a chunk
            self.num_seen += 1
            return self.push(output_ids[-1])
        new = "".join(self.push(t) for t in output_ids[self.num_seen:])
        self.num_seen = len(output_ids)
        return new

    def catch_up_at_once(self, output_ids: list[int]) -> str:
        """catch_up in two decodes, however many tokens are new, not two a token (a server's
        client that fell some steps behind gets them in one piece). Where the new bytes are not
        all whole characters, token by token, as catch_up: the pieces may split differently."""
        new = output_ids[self.num_seen:]
        if len(new) > 1:
            prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
            text = self.decode(self.ids[self.prefix_offset:] + new)
            if len(text) > len(prefix) and "\ufffd" not in text:
                self.ids += new
                self.num_seen = len(output_ids)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                piece = text[len(prefix):]
                self.text += piece
                return piece
        return self.catch_up(output_ids)

    def push(self, token: int) -> str:
        ids, start = self.ids, self.prefix_offset
        ids.append(token)
        prefix = self.decode(ids[start:self.read_offset])
        text = self.decode(ids[start:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            piece = text[len(prefix):]
            self.text += piece
            return piece
        return ""


def chat_messages(prompt: str, system: str | None = None) -> list[dict]:
    """One user message, after a system message if there is one."""
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": prompt}]


def _environment():
    """Jinja as transformers sets it up for chat templates: sandboxed, with loop controls, its two
    helpers and its `tojson` (json.dumps, not Jinja's HTML-safe one: a tool's schema is rendered
    as the model was trained on it)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_template(folder: Path) -> str | None:
    """transformers >= 4.43 may keep the template beside tokenizer_config.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return read_text(jinja)
    path = folder / "chat_template.json"
    template = read_json(path).get("chat_template")
    check_chat_template(template, str(path))
    return template


class _RenderTimeout(BaseException):  # not an Exception: no handler inside jinja may swallow it
    pass


@contextmanager
def _time_limit(seconds: float):
    """Stop the block after `seconds` (a SIGALRM timer: only where Python can take signals, in the
    main thread; elsewhere the length limit alone bounds a render)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(*_):
        raise _RenderTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as a printable character (the bytes that
    are printable Latin-1 as themselves, the others moved to 256 and up), character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(moved)}


BYTE_OF_CHAR = _gpt2_byte_table()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _is_byte_level(decoder: dict | None) -> bool:
    """The tokenizer.json's decoder is ByteLevel, alone or in a Sequence."""
    if not isinstance(decoder, dict):
        return False
    return decoder.get("type") == "ByteLevel" or any(_is_byte_level(d) for d in decoder.get("decoders") or [])


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value
