"""The reference backend: plain torch, written as Hugging Face's LlamaForCausalLM computes.

Attention gathers each sequence's K/V from its blocks (logical block -> physical block -> token
offset) into a padded batch and runs scaled-dot-product attention with a causal mask. That gather
is a read through the block table, done afresh in every layer; nothing is kept between steps.

Key positions a sequence does not own (padding past its context: unassigned table entries, which
read some other block, and the unwritten rest of its own last block, which may hold what a former
owner left; with a sliding window, the keys behind it, whose blocks may be freed and reused) are
zeroed after the gather, not only masked: a masked score weighs 0, but 0 x inf and
0 x NaN are NaN, so one request's overflow would reach its neighbours. Long prefills run in chunks
of query rows, so the mask and the scores stay within ATTENTION_CHUNK_ELEMENTS, not [Lq, Lk]; a
chunked-prefill step runs its decode rows apart from its prompt chunks, unpadded.

An fp8 pool (`store.kv_scales` set) is written as e4m3(x / scale) and read as stored * scale in the
model dtype (model/fp8.py), the scale the layer's per KV head; the gathered keys are dequantized
before the unowned ones are zeroed, so a stray NaN byte is zeroed too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedcli.backends import composed
from pagedcli.core.batch import NOT_FINITE, StepBatch
from pagedcli.core.fp8 import dequantize_kv, quantize_kv, raw
from pagedcli.core.kv_store import KVStore
from pagedcli.model.config import ModelConfig
from pagedcli.model.rope import RotaryTable, apply_rope

# Most mask entries times heads (the scores SDPA may materialize) one attention call handles:
# 2**26, 256 MiB of float32 scores; longer prefills run in chunks of query rows under it.
ATTENTION_CHUNK_ELEMENTS = 1 << 26


class TorchBackend:
    def __init__(self, store: KVStore, config: ModelConfig):
        self.store = store
        self.config = config
        self.block_size = store.geometry.block_size
        self.rope = RotaryTable(config, store.max_model_len, store.device, store.geometry.dtype)
        self.cos, self.sin = self.rope.cos, self.rope.sin  # the static types' tables (None for dynamic)
        self._step: dict = {}  # per-step index tensors shared by all layers

    def prefill_graphs(self, model, max_tokens: int) -> None:
        """No CUDA graphs for prefill-kind steps here: they run eagerly (CudaBackend's capture them)."""
        return None

    # --- the layer's steps around its GEMMs ------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        """RMSNorm in float32, back to x's dtype before the weight multiplies (transformers' order
        of roundings)."""
        r = x.float()
        r = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
        return weight * r.to(x.dtype)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_linear(self, x, norm_weight, weight, eps, bias=None, normed=None):
        """RMSNorm(x) @ weight.T (+ bias): the pre-norm of attention and of the MLP, with the GEMM
        after it."""
        return composed.norm_matmul(self, x, norm_weight, weight, eps, bias, normed)

    def linear(self, x, weight, bias=None):
        """x @ weight.T (+ bias) alone: a partial product under tensor parallelism (model/network.py)."""
        return composed.linear(x, weight, bias)

    def add_norm(self, residual, product, norm_weight, eps):
        """(residual + product, RMSNorm of the sum by norm_weight: None without one)."""
        return composed.add_norm(self, residual, product, norm_weight, eps)

    def linear_add(self, x, weight, residual, bias=None):
        """residual + (x @ weight.T + bias): the o and down projections, back into the residual
        stream. The residual may be updated in place (the CUDA backend does): callers use only what
        is returned."""
        return residual + composed.linear(x, weight, bias)

    def linear_add_norm(self, x, weight, residual, norm_weight, eps, bias=None):
        """linear_add, and the RMSNorm by norm_weight that the new residual meets next (the network
        hands it to that step as `normed`)."""
        return composed.add_norm(self, residual, composed.linear(x, weight, bias), norm_weight, eps)

    def attention_inputs(self, layer: int, x, norm_weight, qkv, eps, batch: StepBatch, bias=None, normed=None,
                         qk_norm=None):
        return composed.attention_inputs(self, layer, x, norm_weight, qkv, eps, batch, bias, normed, qk_norm)

    def norm_linear_silu(self, x, norm_weight, gate_up, eps, bias=None, normed=None):
        return composed.norm_linear_silu(self, x, norm_weight, gate_up, eps, bias, normed)

    def logits(self, x, norm_weight, lm_head, eps, normed=None):
        return composed.logits(self, x, norm_weight, lm_head, eps, normed)

    def logits_greedy(self, x, norm_weight, lm_head, eps, normed=None):
        """The float32 logits and their greedy tokens."""
        logits = self.logits(x, norm_weight, lm_head, eps, normed)
        return logits, self.argmax(logits)

    def argmax(self, logits):
        """Greedy tokens: [B] int64, the first maximum of each row (as torch.argmax); NOT_FINITE for
        a row that holds a NaN or an inf."""
        return torch.where(logits.isfinite().all(dim=-1), logits.argmax(dim=-1), NOT_FINITE)

    # --- positions and the cache --------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        """Index tensors for this step's RoPE, K/V writes, gathers and mask; built once, used by
        every layer."""
        self._step = self._rope_indices(batch) | self._attention_indices(batch)

    def prepare_indices(self, batch: StepBatch, attention: bool, rope: bool) -> None:
        """Only the index tensors of the ops a caller runs here: prefill attention, and per-token
        RoPE (the CUDA backend, where its kernels do not apply)."""
        self._step = self._attention_indices(batch) if attention else {}
        if rope:
            self._step |= self._rope_indices(batch)

    def _rope_indices(self, batch: StepBatch) -> dict:
        """What rope_write_kv needs: each new token's rotary row and where its K/V go.

        Rows at position -1 are padding (a CUDA graph's rows past the real batch) and must write
        nothing: each takes row 0's write instead (the same values to the same place), and when
        row 0 is padding too (so is every row) all write back what is there. Device ops only."""
        positions = batch.positions
        cos, sin = self.rope.rows(positions.clamp(min=0), batch.context_lens[batch.token_seq])
        T = positions.shape[0]
        real = positions >= 0
        source = torch.where(real, torch.arange(T, device=positions.device), 0)
        at = positions.clamp(min=0)[source]
        return {
            "cos": cos, "sin": sin,
            "token_slot": batch.slots.long()[batch.token_seq][source],
            "token_block": at // self.block_size,
            "token_offset": at % self.block_size,
            "write_row": source,
            "write_nothing": ~real[source][:, None, None],
        }

    def _attention_indices(self, batch: StepBatch) -> dict:
        """What attend needs. A step of decode tokens beside prompt chunks (chunked prefill) runs as
        two groups, the one-token rows and the others, so that the decode rows are not padded to
        the length of a chunk."""
        one = [b for b, n in enumerate(batch.num_new) if n == 1]
        if not one or len(one) == len(batch.num_new):
            return self._group_indices(batch)
        more = [b for b, n in enumerate(batch.num_new) if n > 1]
        return {"groups": [self._subgroup(batch, rows) for rows in (one, more)]}

    def _subgroup(self, batch: StepBatch, rows: list[int]) -> tuple[torch.Tensor, dict]:
        """The packed tokens of `rows`, and their attention indices as a batch of their own."""
        dev = batch.token_ids.device
        starts = [0]
        for n in batch.num_new[:-1]:
            starts.append(starts[-1] + n)
        tokens = torch.tensor([t for b in rows for t in range(starts[b], starts[b] + batch.num_new[b])])
        token_seq = torch.tensor([i for i, b in enumerate(rows) for _ in range(batch.num_new[b])])
        tokens, token_seq, index = (t.to(dev, non_blocking=True) for t in (tokens, token_seq, torch.tensor(rows)))
        sub = StepBatch(True, batch.token_ids[tokens], batch.positions[tokens], token_seq, batch.slots[index],
                        batch.context_lens[index], batch.last_index[:0], [batch.num_new[b] for b in rows],
                        [batch.context_lens_host[b] for b in rows])  # (nothing samples from a group)
        return tokens, self._group_indices(sub)

    def _group_indices(self, batch: StepBatch) -> dict:
        """What attend needs for the sequences of `batch`: the keys each sequence gathers through
        its blocks, which of them it owns, the causal mask (whole, or built per chunk of query rows
        when it would be large), and the way from packed tokens to padded rows and back. No host
        sync: shapes come from the batch's host lists."""
        dev = batch.token_ids.device
        Lq, Lk, B = max(batch.num_new), max(batch.context_lens_host), len(batch.num_new)
        key_pos = torch.arange(Lk, device=dev)
        ctx = batch.context_lens.long()
        num_new = torch.tensor(batch.num_new, device=dev)
        starts = torch.cumsum(num_new, 0) - num_new  # first token of each sequence in T
        row = torch.arange(Lq, device=dev)
        q_start = ctx - num_new  # [B] position of each sequence's first query
        owned = key_pos[None, :] < ctx[:, None]  # [B, Lk]: the sequence's own, written keys
        window = self.config.sliding_window
        if window:  # and in its first query's window: the blocks behind it may be freed (engine/cache.py)
            owned &= key_pos[None, :] > q_start[:, None] - window
        chunk = max(1, ATTENTION_CHUNK_ELEMENTS // (B * Lk * self.config.num_heads))
        s = {
            "key_block": (key_pos // self.block_size).clamp(max=self.store.max_blocks_per_seq - 1),
            "key_offset": key_pos % self.block_size,
            "slots": batch.slots.long(),
            "owned": owned[:, :, None, None],  # [B, Lk, 1, 1], against the gathered [B, Lk, kv_heads, head_dim]
            "q_start": q_start,
            "window": window,
            "num_new": num_new,
            "key_pos": key_pos,
            "chunk": chunk,
            "pad_index": (starts[:, None] + row[None, :]).clamp(max=batch.token_ids.numel() - 1),
            "token_row": torch.arange(batch.token_ids.numel(), device=dev) - starts[batch.token_seq],
            "token_seq": batch.token_seq,
        }
        if chunk >= Lq:  # the common case: one mask for every layer
            s["mask"] = self._mask(s, 0, Lq)
        return s

    @staticmethod
    def _mask(s: dict, first: int, stop: int) -> torch.Tensor:
        """[B, 1, rows, Lk] for query rows first..stop-1: a query sees the keys it owns up to its
        own position; a padding row (past its sequence's new tokens) sees key 0 alone, so its
        softmax has something to weigh (its output is dropped)."""
        row = torch.arange(first, stop, device=s["key_pos"].device)
        q_pos = s["q_start"][:, None] + row[None, :]  # [B, rows]
        key_pos = s["key_pos"][None, None, :]
        mask = (key_pos <= q_pos[:, :, None]) & s["owned"][:, None, :, 0, 0]
        if s["window"]:  # a query sees its own position and the window - 1 before it (transformers' rule)
            mask &= key_pos > q_pos[:, :, None] - s["window"]
        mask |= (row[None, :] >= s["num_new"][:, None])[:, :, None] & (key_pos == 0)
        return mask[:, None]

    def rope_write_kv(self, layer: int, q, k, v, batch: StepBatch):
        s = self._step
        q, k = apply_rope(q, s["cos"], s["sin"]), apply_rope(k, s["cos"], s["sin"])
        physical = self.store.device_table[s["token_slot"], layer, s["token_block"]].long()
        pool, offset, row, keep = raw(self.store.pool), s["token_offset"], s["write_row"], s["write_nothing"]
        k, v = k[row], v[row]
        scales = self.store.kv_scales
        if scales is not None:
            k, v = raw(quantize_kv(k, scales.k[layer])), raw(quantize_kv(v, scales.v[layer]))
        pool[physical, 0, offset] = torch.where(keep, pool[physical, 0, offset], k)
        pool[physical, 1, offset] = torch.where(keep, pool[physical, 1, offset], v)
        return q

    def attend(self, layer: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if "groups" not in self._step:
            return self._attend(layer, q, self._step)
        out = torch.empty_like(q)
        for tokens, s in self._step["groups"]:
            out[tokens] = self._attend(layer, q[tokens], s)
        return out

    def _attend(self, layer: int, q: torch.Tensor, s: dict) -> torch.Tensor:
        table = self.store.device_table[:, layer]
        physical = table[s["slots"][:, None], s["key_block"][None, :]].long().clamp(min=0)  # [B, Lk]
        pool = raw(self.store.pool)
        k = pool[physical, 0, s["key_offset"][None, :]]  # [B, Lk, kv_heads, head_dim]
        v = pool[physical, 1, s["key_offset"][None, :]]
        scales = self.store.kv_scales
        if scales is not None:
            k, v = dequantize_kv(k, scales.k[layer], q.dtype), dequantize_kv(v, scales.v[layer], q.dtype)
        # keys the sequence does not own become exact zeros: masked out, and 0 x 0 is 0
        k, v = (torch.where(s["owned"], x, 0) for x in (k, v))
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, Lk, head_dim]
        q_pad = q[s["pad_index"]].transpose(1, 2)  # [B, heads, Lq, head_dim]
        Lq = q_pad.shape[2]
        if "mask" in s:
            out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=s["mask"], enable_gqa=True)
        else:  # a long prefill: chunks of query rows, each with its own slice of the mask
            out = torch.cat([
                F.scaled_dot_product_attention(q_pad[:, :, i:i + s["chunk"]], k, v, enable_gqa=True,
                                               attn_mask=self._mask(s, i, min(i + s["chunk"], Lq)))
                for i in range(0, Lq, s["chunk"])
            ], dim=2)  # [B, heads, Lq, head_dim]
        return out.transpose(1, 2)[s["token_seq"], s["token_row"]]  # [T, heads, head_dim]
