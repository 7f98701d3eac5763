"""The recent families against transformers, as test_architectures_vs_hf does for the older ones: random
weights from transformers' own config and model classes, float32 greedy output token-identical through
the engine (prefix caching, chunked prefill, prompts past every window), bf16 logits within tolerance."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.model.test_architectures_vs_hf import (
    COMMON, assert_bfloat16_logits_close, assert_greedy_matches,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# name -> (config class, model class, config overrides, whether tokens are routed to experts); odd sizes
# fmt: off
CASES = {
    # 7 layers: five local, one global, one local again; the global layer's rope linearly scaled
    "gemma3-5to1-two-bases": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=72, intermediate_size=136, num_hidden_layers=7, num_attention_heads=6,
        num_key_value_heads=2, head_dim=20, query_pre_attn_scalar=30, sliding_window=11,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=500.0,
        initializer_range=0.05,
    ), False),
    "gemma3-softcaps-untied": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=48, intermediate_size=88, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24, sliding_window=9,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=6.0, final_logit_softcapping=4.0, tie_word_embeddings=False,
        initializer_range=0.05,
    ), False),
    # dense layers by mlp_only_layers, and by decoder_sparse_step (layers 0 and 2 of the second)
    "qwen3moe-normtopk-sparse-step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=56, intermediate_size=88, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=20, num_experts=7, num_experts_per_tok=3, moe_intermediate_size=36,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
    ), True),
    "qwen3moe-unnormalised-sliding": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=6,
        num_key_value_heads=3, head_dim=16, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=28,
        norm_topk_prob=False, decoder_sparse_step=2, use_sliding_window=True, sliding_window=13,
        attention_bias=True,
    ), True),
    # interleaved rotary over half of each head (10 of 20 channels), q/k/v biases, fused gate|up
    "glm-partial-interleaved": ("GlmConfig", "GlmForCausalLM", dict(
        hidden_size=60, intermediate_size=84, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=20, partial_rotary_factor=0.5, tie_word_embeddings=False,
    ), False),
    # post-attention and post-MLP norms; a rotary width that is not a power of two (6 of 24)
    "glm4-post-norms": ("Glm4Config", "Glm4ForCausalLM", dict(
        hidden_size=52, intermediate_size=76, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, partial_rotary_factor=0.25, tie_word_embeddings=False,
    ), False),
}
# fmt: on


def build_checkpoint(path: str, case: str, seed: int = 0):
    """Save a random-weight transformers model for `case`; returns the model (float32, eval)."""
    config_cls, model_cls, overrides, _ = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:  # norms and biases start at constants: perturb them so they count
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path, case):
    path = str(tmp_path / case)
    assert_greedy_matches(path, build_checkpoint(path, case))


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_logits_close_to_float32(tmp_path, case):
    path = str(tmp_path / case)
    build_checkpoint(path, case)
    assert_bfloat16_logits_close(path, routed=CASES[case][3])
