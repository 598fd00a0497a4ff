"""Types and ranges of the values a model folder's JSON files hold, checked once as each file is
read: a value of the wrong type or range ends in one line naming the file, the field and the value,
before anything is built from it (a bare int() or bool() would take "64" or "false" silently).

Only shapes of values are checked here; which RoPE types or architectures are supported is the
config parser's business (pagedcli/model/config.py)."""

from __future__ import annotations

import math

from pagedcli.core.errors import RunError, show_value

# config.json: sizes that must be whole numbers of at least 1 (None: the field may be absent or null)
POSITIVE_INTS = {"vocab_size": False, "hidden_size": False, "intermediate_size": False, "num_hidden_layers": False,
                 "num_attention_heads": False, "num_key_value_heads": True, "head_dim": True,
                 "max_position_embeddings": True, "sliding_window": True}
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
TOKEN_IDS = ("bos_token_id", "eos_token_id")
# RoPE dict entries: numbers that must be positive, and the entries each scaling type needs
# (as transformers' rope validation asks)
ROPE_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "rope_theta")
ROPE_NUMBERS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")


def _fail(source: str, field: str, value, why: str, hint: str | None = None):
    raise RunError(f"{source}: {field} {show_value(value)} {why}", hint or f"fix {field} in the file")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_token_ids(d: dict, source: str, fields=TOKEN_IDS) -> None:
    """Token id fields: absent, null, one id, or a list of ids (ids are whole numbers >= 0)."""
    for key in fields:
        value = d.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(is_int(v) and v >= 0 for v in ids):
            _fail(source, key, value, "is not a token id (a whole number of at least 0, or a list of them)")


def check_bools(d: dict, source: str, fields) -> None:
    for key in fields:
        value = d.get(key)
        if value is not None and not isinstance(value, bool):
            _fail(source, key, value, "is not true or false", f"write {key} as true or false, without quotes")


def check_config(d: dict, source: str) -> None:
    """config.json's values, before ModelConfig reads them."""
    for key, optional in POSITIVE_INTS.items():
        value = d.get(key)
        if value is None and (optional or key not in d):
            continue  # a required key that is absent is named by the parser
        if not (is_int(value) and value >= 1):
            _fail(source, key, value, "must be a whole number of at least 1")
    check_bools(d, source, BOOLS)
    check_token_ids(d, source)
    archs = d.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        _fail(source, "architectures", archs, "is not a list of names", 'e.g. ["LlamaForCausalLM"]')
    for key in ("model_type", "hidden_act"):
        if d.get(key) is not None and not isinstance(d[key], str):
            _fail(source, key, d[key], "is not a name", 'e.g. "llama", "silu"')
    eps = d.get("rms_norm_eps")
    if eps is not None and not (is_number(eps) and eps >= 0):
        _fail(source, "rms_norm_eps", eps, "must be a number of at least 0", "Llama uses 1e-5 or 1e-6")
    theta = d.get("rope_theta")
    if theta is not None and not (is_number(theta) and theta > 0):
        _fail(source, "rope_theta", theta, "must be a positive number", "Llama uses 10000 or 500000")
    for key in ("rope_scaling", "rope_parameters"):
        _check_rope(d.get(key), key, source)
    heads, kv_heads = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        _fail(source, "num_key_value_heads", kv_heads, f"does not divide num_attention_heads {heads}",
              "each key/value head serves a whole group of query heads")
    hidden = d.get("hidden_size")
    head_dim = d.get("head_dim") or (hidden // heads if hidden is not None and heads is not None else None)
    if head_dim is not None and head_dim % 2:
        field = "head_dim" if d.get("head_dim") else "hidden_size / num_attention_heads"
        _fail(source, field, head_dim, "is odd: RoPE rotates pairs of dimensions", "every head needs an even size")
    if head_dim == 0:
        _fail(source, "hidden_size", hidden, f"is smaller than num_attention_heads {heads}: heads of size 0",
              "give head_dim, or fix hidden_size")


def _check_rope(rope, key: str, source: str) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        _fail(source, key, rope, "is not an object", 'write it as {"rope_type": ..., "factor": ...}, or null')
    for name in ("rope_type", "type"):
        if rope.get(name) is not None and not isinstance(rope[name], str):
            _fail(source, f"{key}.{name}", rope[name], "is not a name", 'e.g. "llama3", or "default" for none')
    kind = rope.get("rope_type") or rope.get("type")  # as the parser reads it
    for name in ROPE_POSITIVE:  # present, null included, means given: the parser takes it as it is
        if kind == "yarn" and name == "factor" and rope.get(name, 0) is None:
            continue  # transformers' yarn then takes max_position_embeddings / original_max_position_embeddings
        if name in rope and not (is_number(rope[name]) and rope[name] > 0):
            _fail(source, f"{key}.{name}", rope[name], "must be a positive number")
    for name in ROPE_NUMBERS:
        if name in rope and not is_number(rope[name]):
            _fail(source, f"{key}.{name}", rope[name], "must be a number")
    # which entries each type needs, and which types exist: config.rope_settings (rope.REQUIRED_FIELDS)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    if kind == "llama3" and not high > low:  # the blend between them divides by high - low
        _fail(source, f"{key}.high_freq_factor", high, f"must be above low_freq_factor {low}")


def check_generation_config(d: dict, source: str) -> None:
    """generation_config.json's token ids (its sampling values are checked where they are used,
    so that the option they stand in for can override a bad one)."""
    check_token_ids(d, source, ("bos_token_id", "eos_token_id", "pad_token_id"))


def check_tokenizer_config(d: dict, source: str) -> None:
    """tokenizer_config.json: special tokens are text (or {"content": text}); the chat template is
    text, or a list of {"name": ..., "template": ...}."""
    for key in ("bos_token", "eos_token"):
        value = d.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        if text is not None and not isinstance(text, str):
            _fail(source, key, value, "is not a token's text", 'e.g. "<s>"')
    check_bools(d, source, ("add_bos_token",))
    check_chat_template(d.get("chat_template"), source)


def check_chat_template(template, source: str) -> None:
    if template is None or isinstance(template, str):
        return
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                          for t in template):
        return
    _fail(source, "chat_template", template, "is not a template",
          'it must be text, or a list of {"name": ..., "template": ...}; or use `raw`')
