"""A rank's share of the model under tensor parallelism (Megatron-LM's layout, as vLLM's): q/k/v and
gate/up split by heads and columns (their output rows), o and down by their input columns, so that
each rank's attention and MLP run on its own heads and columns and one all-reduce after o and one
after down make the sum; the embedding and the LM head split by vocabulary rows.

A model whose KV heads are fewer than the ranks has them replicated (vLLM's rule): ranks that share a
KV head each hold a copy of it, and their query heads are the ones that read it. The layers' shares
are taken as each layer is read, so a rank holds its share plus one layer in full; the embedding and
the LM head are read whole and then cut (a GGUF file's weights are read whole, then cut).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedcli.core.errors import UsageError
from pagedcli.core.fp8 import KVScales
from pagedcli.core.parallel import vocab_share
from pagedcli.model.config import ModelConfig
from pagedcli.model.fp8 import Fp8Weight
from pagedcli.model.quant import QuantWeight


def check_divides(config: ModelConfig, world: int) -> None:
    """One line for a geometry `world` ranks cannot share; nothing when they can."""
    if world == 1:
        return
    hint = "use a `tensor_parallel_size` that divides it"
    for what, n in (("query heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if n % world:
            raise UsageError(f"`tensor_parallel_size` {world} does not divide the model's {n} {what}", hint)
    kv = config.num_kv_heads
    if kv % world and world % kv:
        raise UsageError(f"`tensor_parallel_size` {world} neither divides the model's {kv} KV heads nor is a "
                         "multiple of them (to replicate them)", hint)


def rank_config(config: ModelConfig, world: int) -> ModelConfig:
    """The network each rank runs: its query heads, KV heads and MLP columns (the vocabulary stays
    whole: the network gathers the LM head's shares)."""
    if world == 1:
        return config
    return replace(config, num_heads=config.num_heads // world, num_kv_heads=max(config.num_kv_heads // world, 1),
                   intermediate_size=config.intermediate_size // world)


def kv_heads_of(config: ModelConfig, world: int, rank: int) -> tuple[int, int]:
    """The KV heads [first, stop) rank `rank` holds of every block."""
    kv = config.num_kv_heads
    if kv >= world:
        share = kv // world
        return rank * share, (rank + 1) * share
    head = rank // (world // kv)  # replicated: world // kv ranks share each KV head
    return head, head + 1


def qkv_rows(config: ModelConfig, world: int, rank: int) -> torch.Tensor:
    """The rows of the fused [q; k; v] weight (and bias) that `rank` holds."""
    d, share = config.head_dim, config.num_heads // world
    q = torch.arange(rank * share * d, (rank + 1) * share * d)
    first, stop = kv_heads_of(config, world, rank)
    kv = torch.arange(first * d, stop * d)
    return torch.cat([q, config.q_dim + kv, config.q_dim + config.kv_dim + kv])


def gate_up_rows(config: ModelConfig, world: int, rank: int) -> torch.Tensor:
    share = config.intermediate_size // world
    gate = torch.arange(rank * share, (rank + 1) * share)
    return torch.cat([gate, config.intermediate_size + gate])


def take_rows(w, rows: torch.Tensor):
    """Output rows `rows` of a linear weight (or a bias), as a tensor of their own."""
    if w is None:
        return None
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.values[rows.to(w.values.device)].contiguous(), w.scale[rows.to(w.scale.device)].contiguous())
    if isinstance(w, QuantWeight):
        pick = rows.to(w.q.device)
        return QuantWeight(w.q[pick].contiguous(), w.scale[pick].contiguous(),
                           None if w.offset is None else w.offset[pick].contiguous(), w.bits, w.group, w.source)
    return w[rows.to(w.device)].contiguous()


def take_columns(w, first: int, stop: int, name: str):
    """Input columns [first, stop) of a linear weight, as a tensor of their own."""
    if isinstance(w, Fp8Weight):  # (a scale per output row: the same for every column)
        return Fp8Weight(w.values[:, first:stop].contiguous(), w.scale)
    if isinstance(w, QuantWeight):
        width = w.shape[1]
        if w.group == width:  # one group a row: the row's scale and offset serve any of its columns
            group, cut = stop - first, slice(0, 1)
        elif first % w.group == 0 and stop % w.group == 0:
            group, cut = w.group, slice(first // w.group, stop // w.group)
        else:
            raise UsageError(f"`tensor_parallel_size`: {name}'s share of {stop - first} inputs is not a whole number "
                             f"of its groups of {w.group}", "use a smaller `tensor_parallel_size`")
        per_byte = 2 if w.bits == 4 else 1
        return QuantWeight(w.q[:, first // per_byte:stop // per_byte].contiguous(), w.scale[:, cut].contiguous(),
                           None if w.offset is None else w.offset[:, cut].contiguous(), w.bits, group, w.source)
    return w[:, first:stop].contiguous()


def vocab_rows(w, vocab: int, world: int, rank: int):
    """The embedding's or LM head's rows of `rank`'s share of the vocabulary."""
    first, stop, _ = vocab_share(vocab, world, rank)
    return take_rows(w, torch.arange(first, stop))


def shard_layer(layer, config: ModelConfig, world: int, rank: int):
    """`rank`'s share of a LayerWeights (model/weights.py): the o and down biases are added once,
    after the all-reduce, so every rank keeps them whole; norms are whole."""
    if world == 1:
        return layer
    qkv, gate_up = qkv_rows(config, world, rank), gate_up_rows(config, world, rank)
    q_share, i_share = config.q_dim // world, config.intermediate_size // world
    return replace(layer, qkv=take_rows(layer.qkv, qkv), qkv_bias=take_rows(layer.qkv_bias, qkv),
                   o=take_columns(layer.o, rank * q_share, (rank + 1) * q_share, "o_proj"),
                   gate_up=take_rows(layer.gate_up, gate_up), gate_up_bias=take_rows(layer.gate_up_bias, gate_up),
                   down=take_columns(layer.down, rank * i_share, (rank + 1) * i_share, "down_proj"))


def shard_kv_scales(scales: KVScales | None, config: ModelConfig, world: int, rank: int) -> KVScales | None:
    if scales is None or world == 1:
        return scales
    first, stop = kv_heads_of(config, world, rank)
    return KVScales(scales.k[:, first:stop].contiguous(), scales.v[:, first:stop].contiguous())


def shard_vocab(weights, config: ModelConfig, world: int, rank: int):
    """`weights` with `rank`'s share of the vocabulary (embedding, LM head) and of the K/V scales;
    the layers as they are."""
    if world == 1:
        return weights
    embed = vocab_rows(weights.embed, config.vocab_size, world, rank)
    lm_head = embed if weights.lm_head is weights.embed else vocab_rows(weights.lm_head, config.vocab_size, world, rank)
    return replace(weights, embed=embed, lm_head=lm_head,
                   kv_scales=shard_kv_scales(weights.kv_scales, config, world, rank))


def shard_weights(weights, config: ModelConfig, world: int, rank: int):
    """`rank`'s share of a whole Weights (a GGUF file's, read whole; the loaders of safetensors and
    random weights take the layers' shares as they read them, then call shard_vocab)."""
    if world == 1:
        return weights
    return replace(shard_vocab(weights, config, world, rank),
                   layers=[shard_layer(lw, config, world, rank) for lw in weights.layers])
