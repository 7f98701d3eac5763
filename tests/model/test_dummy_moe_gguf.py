"""`benchmarks/make_dummy_gguf.py --experts`: the Qwen3-MoE-shaped file the llama.cpp comparison runs loads
in perfxlm as Qwen3-MoE with the shapes asked for, and in llama.cpp where it is installed."""

from __future__ import annotations

import pytest

from tests.model.dummy_gguf import converter


def test_dummy_qwen3moe_file_loads_with_its_shapes(tmp_path):
    from perfxlm import LLM, SamplingParams
    from perfxlm.config import default_model_path
    from perfxlm.model.layers.moe import FusedMoE

    path = str(tmp_path / "moe.gguf")
    converter().write_dummy(path, default_model_path(), hidden=64, layers=2, intermediate=40, heads=4, kv_heads=2,
                            context=256, rope_theta=1e6, seed=0, experts=5, experts_used=3, head_dim=24)
    llm = LLM(path, max_model_len=64, num_kv_blocks=16, enable_prefix_caching=False)
    cfg = llm.llm_engine.config.hf_config
    assert cfg.architectures == ["Qwen3MoeForCausalLM"]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.head_dim) == (5, 3, 40, 24)
    experts = [m for m in llm.llm_engine.core.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and experts[0].gate_up_proj.shape == (5, 80, 64)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(path, n_ctx=64, verbose=False)
    assert model.n_vocab() == cfg.vocab_size
