"""The fused all-decode step (one native call per layer) against the module path it replaces."""

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.config import cpu_has_fast_bf16
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.ops import native

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def _run(llm, monkeypatch, fused: bool):
    calls = {"fused": 0}
    original = FusedDecode.run

    def counting(self, *args):
        calls["fused"] += 1
        return original(self, *args)

    monkeypatch.setattr(FusedDecode, "run", counting)
    if not fused:
        monkeypatch.setattr(FusedDecode, "applies", lambda self, x, meta: False)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    return outs, calls["fused"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_matches_module_path(default_model, monkeypatch, dtype):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    if dtype == "bfloat16" and cpu_has_fast_bf16():
        pytest.skip("bf16 compute on this CPU: the fused layer is for float32 activations")
    llm = LLM(default_model, dtype=dtype, kv_cache_gib=0.5, enable_prefix_caching=False)
    fused, n_fused = _run(llm, monkeypatch, fused=True)
    plain, n_plain = _run(llm, monkeypatch, fused=False)
    assert n_fused >= 20 and n_plain == 0  # the fused path really ran, and then really did not
    # the same kernels in the same order: equal up to float rounding, in bf16 (weights and KV cache) too
    tol = 1e-5
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=tol)


def test_fused_decode_declines_other_layer_shapes(tmp_path):
    """A Qwen3-style layer (per-head q/k norms) is not plain Llama: the module path runs."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", kv_cache_gib=0.1)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.llm_engine.core.model.model.fused_decode.eligible is False
