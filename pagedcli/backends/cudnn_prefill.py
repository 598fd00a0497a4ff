"""Whole long prompts through cuDNN's fused attention (torch SDPA's cuDNN backend), beside
kernels/paged_prefill.cu.

cuDNN's causal attention over a whole long prompt measured far faster than paged_prefill.cu
(mma.sync tiles, FlashAttention-2's scheme): cuDNN's Hopper kernels run on wgmma and TMA
(docs/performance-log.md, "Prefill"). So on sm_90+ a
sequence whose step holds every token it has (no cached prefix: a whole prompt, or the first chunk
of one) and at least CUDNN_MIN_TOKENS of them takes this path; the rest of the step (cached
prefixes, later chunks, short prompts, the decoding rows) stays with our kernels, which read K/V
through the block table in place.

Such a sequence's keys are its step's own tokens from position 0, so SDPA's causal mask (aligned to
the top left) is the prompt's. Its K and V are gathered from the pool through its block table (the
values the decode steps will read, after RoPE, in the pool's dtype; at Llama-3.2-1B ~2 KB a token
a layer), once, straight into the padded rows SDPA reads; q's rows are copied once into theirs.
Pools in the model dtype only: an fp8 pool keeps paged_prefill.cu, which dequantizes as it reads.
No sliding window: torch's SDPA takes a causal mask or a whole mask tensor, not a window, and a
tensor mask would leave cuDNN's fast path; a windowed model's prompts keep paged_prefill.cu, which
reads only each tile's window.

cuDNN plans each new shape the first time it meets it; `pagedcli serve` plans every padded length
its step budget allows before the first request (`warm_up`), as it captures its CUDA graphs.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

# The fewest new tokens a sequence takes through cuDNN: shorter prompts measured as fast through
# paged_prefill.cu, longer ones slower (docs/performance-log.md, "Prefill"). Steps
# replayed from a prefill graph (up to prefill_graphs.MAX_GRAPH_TOKENS tokens) always run our
# kernel: their work is staged, not decided.
CUDNN_MIN_TOKENS = 3072
# cuDNN builds an execution plan for each new shape (slow, once a process), so a
# prompt's rows are padded up to one of 2^PAD_OCTAVE_SPLITS_LOG2 lengths an octave: at most 1/8 more
# rows, and few shapes. The padding is exact: with the causal mask a real row never sees a padded
# key, and the padded rows' outputs are dropped.
PAD_OCTAVE_SPLITS_LOG2 = 3


def padded_length(n: int) -> int:
    """n rounded up to a multiple of 2^(floor(log2 n) - PAD_OCTAVE_SPLITS_LOG2): 16,000 -> 16,384,
    4,000 -> 4,096, 3,100 -> 3,328."""
    step = 1 << max(0, n.bit_length() - 1 - PAD_OCTAVE_SPLITS_LOG2)
    return -(-n // step) * step


def _backends():
    from torch.nn.attention import SDPBackend

    # cuDNN first; should it refuse a shape, FlashAttention (torch's own) rather than an error
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """_causal through cuDNN, in the priority order the path runs (the product and the warm-up)."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_backends(), set_priority=True):
        return _causal(q, k, v, length)


def cudnn_prefill_missing(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, kv_fp8: bool, sliding_window: int | None = None) -> str | None:
    """Why whole prompts cannot take cuDNN's attention on this device, or None: it must be sm_90+
    (where it was measured faster), the pool in the model's 16-bit dtype, no sliding window, and
    cuDNN's SDPA must run a small causal GQA product of these shapes here (tried once, at start)."""
    if sliding_window:
        return f"sliding_window {sliding_window} (SDPA's causal mask has no window; paged_prefill.cu has)"
    if kv_fp8:
        return "an fp8 pool (paged_prefill.cu dequantizes it)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')} (cuDNN's fused attention takes bf16/fp16)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "a GPU older than sm_90"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = 64
    gen = torch.Generator(device).manual_seed(0)  # (the global generator's state is the user's)
    q = torch.randn(n, num_heads, head_dim, device=device, dtype=dtype, generator=gen)
    kv = torch.randn(n, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    try:  # cuDNN alone, with the priority order attend_whole_prompt asks for
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION], set_priority=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's why-not lines for each backend: the reason below says it
            out = _causal(q, kv, kv)
        want = _causal(q.float(), kv.float(), kv.float())
    except TypeError:
        return "this torch's sdpa_kernel takes no priority order (torch 2.6 and newer do)"
    except RuntimeError as e:
        return f"cuDNN's SDPA does not run here ({str(e).splitlines()[0][:120]})"
    if not torch.allclose(out.float(), want, atol=2e-2, rtol=2e-2):
        return "cuDNN's SDPA disagreed with float32 on a trial product"
    return None


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence's rows q [n, heads, d] over k, v [n or length, kv_heads, d]
    (the query heads of a kv head consecutive, as Llama's), computed over `length` >= n rows, the
    ones past n zeros: [n, heads, d]."""
    n = q.shape[0]
    length = length or n

    def rows(x: torch.Tensor) -> torch.Tensor:
        """[1, heads, length, d] as a view of [length, heads, d] rows (zeros past n): SDPA's
        backends take that layout as it lies, so rows already `length` long are not copied."""
        if x.shape[0] != length:
            padded = x.new_empty(length, *x.shape[1:])
            padded[:n] = x
            padded[n:] = 0
            x = padded
        return x.transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, enable_gqa=True)
    return out[0, :, :n].transpose(0, 1)


def whole_prompt_rows(num_new: list[int], context_lens: list[int], first: int) -> list[int]:
    """The sequences of a prefill step, from index `first` on, that take cuDNN's attention: all of
    their context is this step's (nothing cached before it) and it is at least CUDNN_MIN_TOKENS."""
    return [b for b in range(first, len(num_new)) if num_new[b] == context_lens[b] >= CUDNN_MIN_TOKENS]


def gather_kv(store, layer: int, slot: torch.Tensor, n: int,
              length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n keys and values of the sequence in `slot` (a one-element device tensor), from its
    blocks in this layer, as `length` >= n rows (zeros past n): [length, kv_heads, head_dim] each,
    contiguous, copied once (what _causal takes as it lies). No host sync."""
    length = length or n
    geo = store.geometry
    blocks = store.device_table[slot.long(), layer, :-(-n // geo.block_size)].view(-1).long()
    # the pool as halves of blocks, [num_blocks * 2, block_size, kv_heads, head_dim]: block b's K
    # rows are half 2b, its V rows half 2b + 1
    halves = store.pool.view(-1, geo.block_size, geo.num_kv_heads, geo.head_dim)
    whole = blocks.shape[0] * geo.block_size  # the blocks' rows, the last block's stale ones too
    k, v = (halves.new_empty(max(length, whole), geo.num_kv_heads, geo.head_dim) for _ in range(2))
    for out, half in ((k, 0), (v, 1)):
        torch.index_select(halves, 0, 2 * blocks + half, out=out[:whole].view(-1, *halves.shape[1:]))
        out[n:] = 0
    return k[:length], v[:length]


def attend_whole_prompt(store, layer: int, q: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Causal attention of a sequence's every token so far, q [n, heads, d] (its rows of the step),
    over its K/V in the pool (already written this step): [n, heads, d]."""
    length = padded_length(q.shape[0])
    k, v = gather_kv(store, layer, slot, q.shape[0], length)
    return _cudnn_causal(q, k, v, length)


def planned_lengths(max_tokens: int) -> list[int]:
    """Every padded length a whole prompt of CUDNN_MIN_TOKENS to `max_tokens` tokens is run at."""
    return sorted({padded_length(n) for n in range(CUDNN_MIN_TOKENS, max_tokens + 1)})


def warm_up(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            max_tokens: int) -> int:
    """Have cuDNN plan every shape whole prompts of up to `max_tokens` tokens take (zeros; slow for
    each shape, once a process), so that none is planned while other requests decode.
    Returns how many."""
    lengths = planned_lengths(max_tokens)
    for n in lengths:
        q = torch.zeros(n, num_heads, head_dim, device=device, dtype=dtype)
        kv = torch.zeros(n, num_kv_heads, head_dim, device=device, dtype=dtype)
        _cudnn_causal(q, kv, kv, n)
    return len(lengths)
