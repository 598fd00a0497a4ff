"""Every preset's head geometry on the GPU, in bf16, against transformers and against our own torch
reference on the same GPU: the CUDA path (our kernels, CUDA graphs) for each shape a real Llama
checkpoint has. Layers are cut to 2 and the hidden size kept small (the kernels' shapes are the
heads', kv heads' and head_dim's). Skipped without CUDA and CuPy."""

from __future__ import annotations

import pytest
import torch

from helpers import check_block_accounting
from test_oracle import prompts
from test_presets import LLAMA_PRESETS, preset_checkpoint
from pagedcli.model.source import RANDOM_PRESETS
from pagedcli.core.options import SamplingParams


def _cuda_ready() -> bool:
    from pagedcli.backends.cuda import cuda_available

    return cuda_available()[0]


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_ready(), reason="needs CUDA and CuPy")]
STEPS = 24
VOCAB = 512


def gpu_checkpoint(folder, name):
    """The preset's heads, kv heads, head_dim, RoPE and tie, 2 layers; a hidden size of 16 per head,
    so gemv.cu's 16-byte rows apply (its fused path, not only cuBLAS)."""
    from pagedcli.model.config import ModelConfig

    heads = ModelConfig.from_file(RANDOM_PRESETS[name]).num_heads
    return preset_checkpoint(folder, name, hidden_size=16 * heads, intermediate_size=256, vocab_size=VOCAB)


def first_divergence_is_a_near_tie(ours, ref_tokens, ref_logits) -> str:
    """bf16 sums in another (equally valid) order may flip a near-tie: identical tokens, or the
    first difference is within 2% of the logits' scale in transformers' own logits."""
    if ours == ref_tokens:
        return "identical"
    i = next(k for k, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b)
    logits = ref_logits[i][0].float()
    gap, scale = (logits[ref_tokens[i]] - logits[ours[i]]).item(), logits.abs().max().item()
    assert gap <= 0.02 * scale, f"step {i}: ours {ours[i]}, transformers {ref_tokens[i]}, gap {gap} of {scale}"
    return f"near-tie at step {i}"


def each_token_is_the_references_choice_or_a_near_tie(hf, prompt: list[int], ours: list[int]) -> int:
    """transformers over the prompt and our answer in one forward (teacher-forced on our tokens): at
    every step our token is its argmax, or within 2% of the logits' scale of it (bf16 sums in another,
    equally valid, order flip a near-tie, and the answers part there). Each step is checked, those after
    a divergence too: a wrong kernel picks a token far from the argmax somewhere. Returns how many of
    the steps were near-ties."""
    ids = torch.tensor([prompt + ours[:-1]], device="cuda")
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:].float()
    chosen = logits.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
    gap, scale = logits.max(1).values - chosen, logits.abs().max(1).values
    worst = int((gap / scale).argmax())
    assert (gap <= 0.02 * scale).all(), f"step {worst}: ours {ours[worst]}, gap {gap[worst]:.4f} of {scale[worst]:.4f}"
    return int((gap > 0).sum())


def answers_match_transformers(loaded, folder, label: str):
    """Greedy answers of four prompts in `loaded`'s CUDA engine, block accounting checked every step
    and the pool whole at the end, each token transformers' choice (or a near-tie) in bf16 on the
    same GPU. Returns the engine."""
    from helpers import hf_model

    engine = loaded.engine
    prompt_list = prompts([1, 16, 17, 45], VOCAB, seed=4)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=STEPS, ignore_eos=True)) for p in prompt_list]
    while engine.has_unfinished:
        engine.step()
        check_block_accounting(engine)
    assert engine.cache.num_free_blocks == engine.cache.geometry.num_blocks
    hf = hf_model(folder, dtype=torch.bfloat16, device="cuda")
    near_ties = [each_token_is_the_references_choice_or_a_near_tie(hf, prompt, seq.output_token_ids)
                 for seq, prompt in zip(seqs, prompt_list)]
    print(label, "near-ties a prompt:", near_ties)
    # (random weights of 512 tokens have flat logits: llama-2-7b's answers parted from transformers' at
    # a near-tie in all four prompts, at steps 3 to 23, and the presets had 0 to 3 near-ties in 96 steps;
    # a wrong kernel is off the argmax at most steps)
    assert sum(near_ties) <= len(prompt_list) * STEPS // 10, near_ties
    return engine


@pytest.mark.parametrize("batch", [4, 1], ids=["cublas", "gemv"])
@pytest.mark.parametrize("name", LLAMA_PRESETS)  # (the other families': test_gpu_families.py)
def test_preset_heads_on_cuda_match_transformers(tmp_path, make_engine, name, batch):
    folder = gpu_checkpoint(tmp_path, name)
    loaded = make_engine(folder, device="cuda", dtype="bfloat16", batch=batch, num_blocks=256)
    answers_match_transformers(loaded, folder, f"{name} {batch}")


EXTRAS = {  # what only some checkpoints have: biases (torch GEMMs on CUDA) and the RoPE types
    "biases": dict(attention_bias=True, mlp_bias=True),
    "dynamic-ntk": dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=24),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                 max_position_embeddings=64),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_biases_and_rope_types_on_cuda_match_transformers(tmp_path, make_engine, extra):
    from transformers import LlamaForCausalLM

    from conftest import hf_checkpoint

    folder = hf_checkpoint(tmp_path, **dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                            hidden_size=128, intermediate_size=256, vocab_size=VOCAB) | EXTRAS[extra])
    loaded = make_engine(folder, device="cuda", dtype="bfloat16", batch=1, num_blocks=64)
    prompt = prompts([20], VOCAB, seed=5)[0]  # past the short trained lengths above, with the answer
    seq = loaded.engine.run_to_completion([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    # (generate, not one teacher-forced forward: dynamic NTK's frequencies follow the length so far)
    out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=STEPS, min_new_tokens=STEPS,
                      do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                      eos_token_id=None)
    print(extra, first_divergence_is_a_near_tie(seq.output_token_ids, out.sequences[0, len(prompt):].tolist(),
                                                out.logits))
