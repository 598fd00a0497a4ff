"""A GGUF file's vocabulary (tokenizer.ggml.*) as a `tokenizers` Tokenizer, built as transformers'
GGUF conversion builds it (transformers/integrations/gguf/gguf_tokenizer_mapping.py, and the
GPT2Tokenizer / LlamaTokenizer classes it hands the vocabulary to), so that its ids are the
oracle's (tests/test_gguf.py holds them equal):

- "gpt2": byte-level BPE. Tokens spelled outside GPT-2's byte alphabet are respelled byte by
  byte; GPT-2's pre-tokenizer, unless tokenizer.ggml.pre names one of the splits transformers
  knows (Llama 3's, Qwen2's, ...); the ByteLevel decoder.
- "llama": SentencePiece BPE with byte fallback: the merges from the file, or (older files) from
  the vocabulary and its scores; "▁" prepended to the first word only (transformers' non-legacy
  Metaspace); BOS added unless tokenizer.ggml.add_bos_token says no.

Control tokens (token type 3) become special added tokens, user-defined ones (4) plain added
tokens: matched whole in text. Every other vocabulary type is refused in one line.
"""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from pagedcli.core.errors import RunError
from pagedcli.model.tokenizer import BYTE_OF_CHAR, Tokenizer, _first_line

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
TYPES = ("gpt2", "llama")

# transformers' GGUF_PRE_TOKENIZER_SPLITS (the pre-tokenizer names llama.cpp writes -> the split
# the vocabulary was learned with); any other name keeps GPT-2's split, as transformers does
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
          "tekken": _TEKKEN, **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O)}


def gguf_tokenizer(meta: dict, source: str) -> Tokenizer | None:
    """The tokenizer the metadata describes; None when the file has no vocabulary."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TYPES:
        raise RunError(f"{source}: tokenizer.ggml.model {kind!r} is not supported",
                       "pagedcli reads GPT-2-style BPE (gpt2) and SentencePiece (llama) vocabularies")
    if not isinstance(tokens, list):
        raise RunError(f"{source}: tokenizer.ggml.tokens is not a list of strings", "download the file again")
    types = _numbers(meta, "tokenizer.ggml.token_type", len(tokens), source)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and not isinstance(merges, list):
        raise RunError(f"{source}: tokenizer.ggml.merges is not a list of strings", "download the file again")
    scores = _numbers(meta, "tokenizer.ggml.scores", len(tokens), source) if kind == "llama" else None
    if kind == "llama" and merges is None and scores is None:
        raise RunError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.merges or tokenizer.ggml.scores",
                       "download the file again")
    try:
        tok = _byte_level(tokens, merges or []) if kind == "gpt2" else _sentencepiece(tokens, merges, scores)
    except Exception as e:  # tokenizers refuses a merge that is not two of the vocabulary's tokens (a bare Exception)
        raise RunError(f"{source}: its vocabulary could not be built ({_first_line(e)})",
                       "download the file again") from None
    special = {name: _token(meta, f"tokenizer.ggml.{key}", tokens, source)
               for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                                 ("pad", "padding_token_id"))}
    _add_tokens(tok, tokens, types, kind == "gpt2", [t for t in special.values() if t is not None])
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if kind == "gpt2" and split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp's default for SentencePiece
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise RunError(f"{source}: tokenizer.chat_template is not text", "download the file again")
    return Tokenizer.from_tokenizer(tok, bos_token=special["bos"], eos_token=special["eos"], add_bos=bool(add_bos),
                                    chat_template=template)


def _byte_level(tokens: list[str], merges: list[str]) -> HFTokenizer:
    """GPT2Tokenizer's: a token outside the byte alphabet is respelled through it (later duplicates
    win, as in transformers' dict)."""
    char_of_byte = {b: c for c, b in BYTE_OF_CHAR.items()}
    vocab = {t if set(t) <= BYTE_OF_CHAR.keys() else "".join(char_of_byte[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    tok = HFTokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                          continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list[float] | None) -> HFTokenizer:
    """LlamaTokenizer's (non-legacy: "▁" before the first word only)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges] if merges is not None else _merges_from_scores(vocab, tokens, scores)
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok


def _merges_from_scores(vocab: dict[str, int], tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """transformers' generate_merges(vocab, scores): every split of a token into two tokens, best
    score first (then the shorter left piece, then the shorter right one)."""
    by_score = dict(zip(tokens, scores))
    merges = []
    for merge, score in by_score.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _add_tokens(tok: HFTokenizer, tokens: list[str], types: list[int] | None, byte_level: bool,
                named: list[str]) -> None:
    """Control tokens as special tokens (in a byte-level vocabulary only those spelled in its
    alphabet: another is llama.cpp's mislabel, and would be a new id), user-defined ones as plain
    added tokens; then the named special tokens (bos, eos, unk, pad), as transformers' tokenizer
    class adds them."""
    types = types or []
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and (not byte_level or set(t) <= BYTE_OF_CHAR.keys())]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    have = {t.content for t in tok.get_added_tokens_decoder().values()}
    extra = [AddedToken(t, special=True) for t in dict.fromkeys(named) if t not in have]
    if extra:
        tok.add_special_tokens(extra)


def _numbers(meta: dict, key: str, count: int, source: str) -> list | None:
    """A per-token array of numbers (token types, scores): one a token."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf":
        raise RunError(f"{source}: {key} is not an array of numbers", "download the file again")
    if len(value) != count:
        raise RunError(f"{source}: {key} has {len(value)} entries for {count} tokens", "download the file again")
    return value.tolist()


def _token(meta: dict, key: str, tokens: list[str], source: str) -> str | None:
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < len(tokens):
        raise RunError(f"{source}: {key} {value!r} is not a token of the vocabulary ({len(tokens)} tokens)",
                       "download the file again")
    return tokens[value]
