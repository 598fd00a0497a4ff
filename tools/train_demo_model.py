#!/usr/bin/env python3
"""Train a tiny Llama on tiny Shakespeare and write a Hugging Face model folder.

What it does
    1. Reads the corpus and holds out its last 10% (cut at a paragraph / newline
       boundary) for validation.
    2. Trains a byte-level BPE tokenizer (2048 tokens, Llama-3 style special tokens
       ``<|begin_of_text|>`` = 0 and ``<|end_of_text|>`` = 1, BOS prepended by the
       post-processor) on the training 90% only, and checks that it round-trips.
    3. Trains a ~3.5M-parameter ``LlamaForCausalLM`` (5 layers, hidden 256,
       4 query heads / 2 KV heads of size 64, tied embeddings) on random
       256-token windows (BOS + 255 tokens) for a wall-clock budget, with AdamW,
       linear warm-up and a cosine decay driven by the elapsed fraction of the
       budget, bf16 autocast on CUDA and a little residual dropout (training
       only, via forward hooks). It evaluates the validation loss on the whole
       held-out text every ``--eval-seconds``, keeps the weights with the best
       one (tiny Shakespeare overfits quickly) and stops early once the best is
       ``--patience-seconds`` old.
    4. Writes a normal Hugging Face folder to ``--out``: config.json,
       model.safetensors (bf16), generation_config.json, tokenizer.json,
       tokenizer_config.json and training.json (metrics, hyper-parameters and a
       greedy sample produced by reloading the folder with transformers).

Data
    tinyshakespeare: 40,000 lines of Shakespeare's plays (public domain), as
    collected by Andrej Karpathy in char-rnn (https://github.com/karpathy/char-rnn,
    MIT licence), data/tinyshakespeare/input.txt.

How to run
    GPU (the real run, ~6 minutes of training plus well under a minute of setup,
    evaluation and saving):
        python tools/train_demo_model.py --out /path/to/demo-model
    CPU smoke test (a few seconds of training):
        python tools/train_demo_model.py --out /tmp/demo_smoke --minutes 0.5 \\
            --max-steps 20 --device cpu

Notes
    * The learning-rate schedule follows wall-clock time, so two runs with the
      same seed are only identical when they also run the same number of steps;
      everything else (init, data order, tokenizer) is seeded.
    * ``tokens_seen`` in training.json counts predicted (target) tokens:
      steps * batch_size * 255.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
BOS_ID, EOS_ID = 0, 1
VOCAB_SIZE = 2048
SEQ_LEN = 256  # window length including the leading BOS
VAL_FRACTION = 0.10
MAX_SAFETENSORS_BYTES = 8_000_000
SAMPLE_PROMPT = "ROMEO:"
SAMPLE_NEW_TOKENS = 60

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT / ".." / "shared" / "data" / "tinyshakespeare.txt"


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a tiny Llama on tiny Shakespeare; write a Hugging Face folder.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="training corpus (UTF-8 text)")
    p.add_argument("--out", type=Path, required=True, help="output model folder")
    p.add_argument("--minutes", type=float, default=6.0, help="wall-clock training budget")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="optional cap on optimizer steps")
    p.add_argument("--batch-size", type=int, default=None,
                   help="windows per step (default: 64 on CUDA, 8 on CPU)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="residual dropout on attention/MLP outputs while training "
                        "(forward hooks; the saved model has none)")
    p.add_argument("--eval-seconds", type=float, default=None,
                   help="validate every N seconds (default: 5 on CUDA, 30 on CPU)")
    p.add_argument("--patience-seconds", type=float, default=120.0,
                   help="stop early when the best val loss is this many seconds old (0: never)")
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--log-seconds", type=float, default=10.0, help="print progress every N seconds")
    p.add_argument("--compile", action="store_true",
                   help="try torch.compile (falls back to eager if it fails)")
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 64 if str(args.device).startswith("cuda") else 8
    if args.eval_seconds is None:
        args.eval_seconds = 5.0 if str(args.device).startswith("cuda") else 30.0
    return args


# -------------------------------------------------------------------------- data


def load_corpus(path: Path) -> tuple[str, str]:
    """Return (text, sha256 of the file's bytes)."""
    raw = path.read_bytes()
    return raw.decode("utf-8"), hashlib.sha256(raw).hexdigest()


def split_train_val(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Hold out the last `val_fraction` of the characters, cut at a line boundary.

    Prefers a blank line (paragraph boundary) near the cut so validation starts
    with a speaker's name; falls back to any newline.
    """
    cut = int(len(text) * (1.0 - val_fraction))
    para = text.rfind("\n\n", 0, cut)
    if para != -1 and cut - para < 5000:
        split = para + 2
    else:
        nl = text.rfind("\n", 0, cut)
        if nl == -1:
            raise ValueError("corpus has no newline to split at")
        split = nl + 1
    return text[:split], text[split:]


def paragraphs(text: str) -> list[str]:
    """Split text after every blank line; the pieces concatenate back to `text`."""
    pieces = [p for p in re.split(r"(?<=\n\n)", text) if p]
    assert "".join(pieces) == text
    return pieces


# --------------------------------------------------------------------- tokenizer


def train_tokenizer(train_text: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],  # first, so they get ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes
        min_frequency=2,
        show_progress=False,
    )
    pieces = paragraphs(train_text)
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def check_tokenizer(tok, val_text: str) -> None:
    assert tok.token_to_id(BOS_TOKEN) == BOS_ID, tok.token_to_id(BOS_TOKEN)
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID, tok.token_to_id(EOS_TOKEN)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    lines = [ln for ln in val_text.splitlines(keepends=True) if ln.strip()][:8]
    samples = lines + [val_text[:2000], "  odd  spacing\tand ünïcödé — ok?\n"]
    for s in samples:
        enc = tok.encode(s)
        assert enc.ids[0] == BOS_ID, f"BOS not prepended: {enc.ids[:4]}"
        assert BOS_ID not in enc.ids[1:]
        back = tok.decode(enc.ids[1:], skip_special_tokens=False)
        assert back == s, f"tokenizer round trip failed: {s!r} -> {back!r}"


def encode_stream(tok, text: str) -> list[int]:
    """Encode `text` paragraph by paragraph (no BOS) and concatenate the ids."""
    ids: list[int] = []
    for enc in tok.encode_batch(paragraphs(text), add_special_tokens=False):
        ids.extend(enc.ids)
    return ids


# ------------------------------------------------------------------------- model


def build_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=True,
    )


def add_residual_dropout(model, p: float) -> list:
    """Dropout on each layer's attention and MLP output (training mode only).

    LlamaForCausalLM has no residual dropout of its own; forward hooks add it
    without changing the architecture or the saved weights. Returns the hook
    handles (call .remove() on them to take it out again).
    """
    if p <= 0:
        return []

    def hook(module, inputs, output):
        return F.dropout(output, p, training=True) if module.training else output

    handles = []
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            handles.append(proj.register_forward_hook(hook))
    return handles


def make_optimizer(model, lr: float, weight_decay: float, device: str):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    if device.startswith("cuda"):
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except Exception as e:  # pragma: no cover - depends on the torch build
            log(f"fused AdamW unavailable ({e}); using the default implementation")
    return torch.optim.AdamW(groups, **kw)


def lr_at(step: int, frac: float, args) -> float:
    """Linear warm-up over steps, then cosine decay to min_lr_ratio over `frac` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    frac = min(max(frac, 0.0), 1.0)
    cos = 0.5 * (1.0 + math.cos(math.pi * frac))
    return args.lr * warm * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def autocast_ctx(device: str):
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 elsewhere."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def window_loss(model, windows: torch.Tensor, labels: torch.Tensor, reduction: str):
    """Cross-entropy of `windows[:, :-1]` predicting `labels` (= windows[:, 1:], -100 = ignore)."""
    logits = model(input_ids=windows, use_cache=False).logits[:, :-1]
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        ignore_index=-100,
        reduction=reduction,
    )


# -------------------------------------------------------------------- batching


def sample_batch(train_ids: torch.Tensor, batch_size: int, gen: torch.Generator):
    """Random windows: BOS followed by SEQ_LEN - 1 consecutive training tokens.

    `gen` lives on train_ids' device, so sampling never syncs with the host.
    """
    span = SEQ_LEN - 1
    dev = train_ids.device
    starts = torch.randint(0, train_ids.numel() - span + 1, (batch_size,),
                           generator=gen, device=dev)
    idx = starts[:, None] + torch.arange(span, device=dev)
    body = train_ids[idx]
    bos = torch.full((batch_size, 1), BOS_ID, dtype=body.dtype, device=body.device)
    windows = torch.cat([bos, body], dim=1)
    return windows, windows[:, 1:]


def make_val_windows(val_ids: list[int], device: str):
    """Non-overlapping windows covering every validation token once, BOS first.

    Returns (windows [W, SEQ_LEN], labels [W, SEQ_LEN - 1]); padding is -100 in the labels.
    """
    span = SEQ_LEN - 1
    n_win = math.ceil(len(val_ids) / span)
    windows = torch.full((n_win, SEQ_LEN), EOS_ID, dtype=torch.long)
    labels = torch.full((n_win, span), -100, dtype=torch.long)
    windows[:, 0] = BOS_ID
    for w in range(n_win):
        chunk = torch.tensor(val_ids[w * span:(w + 1) * span], dtype=torch.long)
        windows[w, 1:1 + chunk.numel()] = chunk
        labels[w, :chunk.numel()] = chunk
    return windows.to(device), labels.to(device)


@torch.no_grad()
def evaluate(model, val_windows, val_labels, batch_size: int, device: str) -> float:
    """Mean cross-entropy (nats/token) over all validation tokens."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=val_windows.device)
    for i in range(0, val_windows.size(0), batch_size):
        with autocast_ctx(device):
            total += window_loss(model, val_windows[i:i + batch_size],
                                 val_labels[i:i + batch_size], "sum").double()
    model.train(was_training)
    return (total / (val_labels != -100).sum()).item()


# ---------------------------------------------------------------------- training


def try_compile(model, enabled: bool):
    if not enabled:
        return model
    try:
        return torch.compile(model)
    except Exception as e:
        log(f"torch.compile failed ({e!r}); training eagerly")
        return model


def train(model, train_ids, val_windows, val_labels, args) -> dict:
    """Train for the wall-clock budget; return stats and the best (fp32, CPU) state dict."""
    device = args.device
    budget = args.minutes * 60.0
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    gen = torch.Generator(device=train_ids.device).manual_seed(args.seed + 1)
    dropout_hooks = add_residual_dropout(model, args.dropout)
    fwd = try_compile(model, args.compile)
    compiled = fwd is not model

    best = {"val_loss": float("inf"), "step": 0, "state": None, "elapsed": 0.0}
    step = 0
    t0 = time.perf_counter()
    last_eval = last_log = t0
    run_loss = torch.zeros((), device=device)
    run_n = 0
    tokens_per_step = args.batch_size * (SEQ_LEN - 1)
    val_loss = float("nan")
    stop_reason = "time budget"

    def do_eval(now: float) -> float:
        v = evaluate(model, val_windows, val_labels, args.eval_batch_size, device)
        if v < best["val_loss"] or best["state"] is None:  # NaN never compares smaller
            best.update(val_loss=v, step=step, elapsed=now - t0,
                        state={k: t.detach().float().cpu().clone()
                               for k, t in model.state_dict().items()})
        return v

    model.train()
    while True:
        now = time.perf_counter()
        elapsed = now - t0
        if elapsed >= budget:
            break
        if args.max_steps is not None and step >= args.max_steps:
            stop_reason = "max steps"
            break

        frac = elapsed / budget
        if args.max_steps:
            frac = max(frac, step / args.max_steps)
        lr = lr_at(step, frac, args)
        for g in opt.param_groups:
            g["lr"] = lr

        windows, labels = sample_batch(train_ids, args.batch_size, gen)
        try:
            with autocast_ctx(device):
                loss = window_loss(fwd, windows, labels, "mean")
            loss.backward()
        except Exception as e:
            if not compiled:
                raise
            log(f"compiled step failed ({e!r}); falling back to eager")
            fwd, compiled = model, False
            opt.zero_grad(set_to_none=True)
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run_loss += loss.detach()
        run_n += 1
        step += 1

        now = time.perf_counter()
        evaluated = False
        if now - last_eval >= args.eval_seconds:
            val_loss = do_eval(now)
            last_eval = now = time.perf_counter()
            evaluated = True
        if evaluated or now - last_log >= args.log_seconds:
            train_loss = (run_loss / max(1, run_n)).item()
            el = now - t0
            best_txt = f"{best['val_loss']:.4f}@{best['step']}" if best["state"] else "-"
            log(f"step {step:6d}  lr {lr:.2e}  train {train_loss:.4f}  val {val_loss:.4f}  "
                f"best {best_txt}  "
                f"{step * tokens_per_step / max(el, 1e-9):,.0f} tok/s  {el:6.1f}s")
            run_loss.zero_()
            run_n = 0
            last_log = now
            if not math.isfinite(train_loss):
                stop_reason = "non-finite training loss"
                log("training loss is not finite; stopping and keeping the best weights")
                break
        if (evaluated and args.patience_seconds > 0 and best["state"] is not None
                and now - t0 - best["elapsed"] >= args.patience_seconds):
            stop_reason = f"no val improvement for {args.patience_seconds:g}s"
            break

    for h in dropout_hooks:
        h.remove()
    # Final evaluation of the last weights (they may be the best).
    if step > 0 and stop_reason != "non-finite training loss":
        val_loss = do_eval(time.perf_counter())
    if best["state"] is None:  # e.g. zero steps, or diverged before any eval
        val_loss = do_eval(time.perf_counter())
    elapsed = time.perf_counter() - t0
    log(f"training stopped ({stop_reason}) after {step} steps, {elapsed:.1f}s; "
        f"last val {val_loss:.4f}, best val {best['val_loss']:.4f} at step {best['step']}")
    return {
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "train_seconds": elapsed,
        "stop_reason": stop_reason,
        "best_val_loss": best["val_loss"],
        "best_step": best["step"],
        "best_elapsed_s": best["elapsed"],
        "last_val_loss": val_loss,
        "compiled": compiled,
        "best_state": best["state"],
    }


# ------------------------------------------------------------------------ saving


def save_model(model, best_state: dict, out: Path) -> None:
    model.load_state_dict(best_state)
    model = model.to(torch.bfloat16)
    try:
        model.save_pretrained(out, safe_serialization=True)
    except TypeError:  # a transformers that dropped the (always-on) flag
        model.save_pretrained(out)
    fix_config(out / "config.json")
    os.chmod(out / "model.safetensors", 0o644)  # some transformers versions write it 0600


def fix_config(path: Path) -> None:
    """Make config.json readable by both transformers 4.x/5.x and simple readers."""
    cfg = json.loads(path.read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:  # transformers 5 nests it under rope_parameters
        cfg["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def save_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    # sampling by default: greedy decoding of a model this small loops on one line
    gen_cfg = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": True, "temperature": 0.8, "top_p": 0.95}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")


def reload_and_sample(out: Path, device: str, val_windows, val_labels, eval_bs: int) -> dict:
    """Reload the saved bf16 folder with transformers; greedy sample; bf16 val loss."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(device).eval()
    assert model.dtype == torch.bfloat16, model.dtype
    ids = torch.tensor([tok.encode(SAMPLE_PROMPT).ids], device=device)
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=SAMPLE_NEW_TOKENS,
            do_sample=False,
            pad_token_id=EOS_ID,
        )
    new_ids = gen[0, ids.shape[1]:].tolist()
    result = {
        "prompt": SAMPLE_PROMPT,
        "max_new_tokens": SAMPLE_NEW_TOKENS,
        "token_ids": new_ids,
        "text": SAMPLE_PROMPT + tok.decode(new_ids, skip_special_tokens=False),
    }
    # The bf16 weights' validation loss (what an inference engine should reproduce).
    # On CPU bf16 matmuls are slow, so only do this on an accelerator.
    if device.startswith("cuda"):
        # No autocast ("cpu" turns it off): the weights themselves are bf16 now.
        result["val_loss_bf16"] = evaluate(model, val_windows, val_labels, eval_bs, "cpu")
    return result


def write_json(path: Path, obj) -> None:
    """Indented JSON, but with lists of numbers kept on one line."""
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    text = re.sub(r"\[\s+([-\d.,\s]+?)\s+\]",
                  lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    path.write_text(text + "\n")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


# -------------------------------------------------------------------------- main


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    seed_everything(args.seed)
    device = args.device
    torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls on CUDA
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    import transformers
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"device {device} ({device_name(device)}), budget {args.minutes} min")

    text, sha = load_corpus(args.data)
    train_text, val_text = split_train_val(text)
    log(f"corpus {args.data} ({len(text):,} chars, sha256 {sha[:12]}…): "
        f"train {len(train_text):,} chars, val {len(val_text):,} chars")

    tok = train_tokenizer(train_text)
    check_tokenizer(tok, val_text)
    train_list = encode_stream(tok, train_text)
    val_list = encode_stream(tok, val_text)
    log(f"tokenizer: vocab {tok.get_vocab_size()}; train {len(train_list):,} tokens "
        f"({len(train_text) / len(train_list):.2f} chars/token), val {len(val_list):,} tokens "
        f"[{time.perf_counter() - t_start:.1f}s]")

    train_ids = torch.tensor(train_list, dtype=torch.long, device=device)
    val_windows, val_labels = make_val_windows(val_list, device)

    from transformers import LlamaForCausalLM
    config = build_config()
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters; batch {args.batch_size} x {SEQ_LEN} tokens")

    stats = train(model, train_ids, val_windows, val_labels, args)
    best_state = stats.pop("best_state")

    save_model(model, best_state, out)
    save_tokenizer(tok, out)
    st_bytes = (out / "model.safetensors").stat().st_size
    log(f"saved {out} (model.safetensors {st_bytes:,} bytes)")
    assert st_bytes <= MAX_SAFETENSORS_BYTES, f"model.safetensors too big: {st_bytes}"

    exit_code = 0
    try:
        sample = reload_and_sample(out, device, val_windows, val_labels, args.eval_batch_size)
        log(f"sample: {sample['text']!r}")
    except Exception as e:  # keep the folder and report the failure
        traceback.print_exc()
        sample = {"prompt": SAMPLE_PROMPT, "error": repr(e)}
        exit_code = 1

    hyper = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
             if k not in ("data", "out", "device", "seed")}
    hyper.update(seq_len=SEQ_LEN, val_fraction=VAL_FRACTION, precision=(
        "fp32 weights, bf16 autocast" if device.startswith("cuda") else "fp32"))
    best_val = stats["best_val_loss"]
    report = {
        "val_loss": best_val if math.isfinite(best_val) else None,
        "val_perplexity": math.exp(best_val) if math.isfinite(best_val) else None,
        "val_tokens": len(val_list),
        "val_chars": len(val_text),
        "train_tokens": len(train_list),
        "train_chars": len(train_text),
        "steps": stats["steps"],
        "tokens_seen": stats["tokens_seen"],
        "minutes": round(stats["train_seconds"] / 60.0, 3),
        "total_minutes": round((time.perf_counter() - t_start) / 60.0, 3),
        "best_step": stats["best_step"],
        "best_at_minutes": round(stats["best_elapsed_s"] / 60.0, 3),
        "val_loss_bf16_reloaded": sample.pop("val_loss_bf16", None),
        "last_val_loss": stats["last_val_loss"] if math.isfinite(stats["last_val_loss"]) else None,
        "stop_reason": stats["stop_reason"],
        "torch_compile": stats["compiled"],
        "device": device,
        "device_name": device_name(device),
        "parameters": n_params,
        "safetensors_bytes": st_bytes,
        "hyperparameters": hyper,
        "seed": args.seed,
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "corpus": {
            "file": args.data.name,
            "sha256": sha,
            "source": "tinyshakespeare (Shakespeare's plays, public domain), "
                      "collected by Andrej Karpathy in char-rnn (MIT)",
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "sample": sample,
    }
    write_json(out / "training.json", report)
    log(f"done: best val loss {best_val:.4f} nats/token (ppl {math.exp(min(best_val, 700)):.2f}); "
        f"total {report['total_minutes']:.2f} min")
    if not math.isfinite(best_val):
        log("ERROR: the validation loss is not finite; the saved model is unusable")
        exit_code = 1
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
