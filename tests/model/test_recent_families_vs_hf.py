"""The recent families against transformers, as test_architectures_vs_hf does for the older ones: random
weights from transformers' own config and model classes, float32 greedy output token-identical through
the engine (prefix caching, chunked prefill, prompts past every window), bf16 logits within tolerance."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.model.test_architectures_vs_hf import (
    COMMON,
    assert_bfloat16_logits_close,
    assert_greedy_matches,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


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
    # MLA without a query bottleneck (V2-Lite's shape), YaRN with mscale, a dense first layer, two shared
    # experts, greedy softmax routing
    "deepseekv2-lite-yarn": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        hidden_size=60, intermediate_size=92, moe_intermediate_size=26, num_hidden_layers=3,
        num_attention_heads=5, num_key_value_heads=5, q_lora_rank=None, kv_lora_rank=36,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=14, n_routed_experts=7, num_experts_per_tok=3,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=1.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    ), True),
    # the query bottleneck, group-limited routing (2 of 3 groups), a routed scaling factor
    "deepseekv2-grouped-qlora": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        hidden_size=48, intermediate_size=80, moe_intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=28, kv_lora_rank=20,
        qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=9, n_routed_experts=9, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=3,
        topk_group=2, routed_scaling_factor=1.5,
    ), True),
    # sigmoid scores with a correction bias, groups by their two best, renormalised, scaled; dense first
    "deepseekv3-noaux-grouped": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=56, intermediate_size=84, moe_intermediate_size=22, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=30, kv_lora_rank=28,
        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ), True),
    "deepseekv3-rotate-half": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=40, intermediate_size=64, moe_intermediate_size=18, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=22,
        qk_nope_head_dim=10, qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, rope_interleave=False,
    ), True),
    # sinks, sliding and full layers alternating, YaRN without truncation, biased experts, clamped SwiGLU
    "gptoss-sinks-alternating": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=48, intermediate_size=36, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, sliding_window=11, num_local_experts=5, num_experts_per_tok=2,
        swiglu_limit=1.5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 15000.0},
    ), True),
}
# fmt: on


def build_checkpoint(path: str, case: str, seed: int = 0, **changes):
    """Save a random-weight transformers model for `case` (`changes`: config fields set otherwise);
    returns the model (float32, eval)."""
    config_cls, model_cls, overrides, _ = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides, **changes})
    model = getattr(transformers, model_cls)(config).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the grouped-GEMM one needs 16-byte aligned odd sizes
    perturb(model)
    model.save_pretrained(path)
    return model


@torch.no_grad()
def perturb(model: torch.nn.Module) -> None:
    """Random values where a fresh model holds constants, so every parameter counts in a comparison."""
    for name, param in model.named_parameters():
        if name.endswith("sinks"):  # gpt-oss: sink logits big enough to take much of the attention
            param.copy_(torch.randn_like(param) * 2)
        elif param.ndim == 1:  # norms and biases start at constants: perturb them so they count
            param.add_(torch.randn_like(param) * 0.1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias, zero at first
            buffer.copy_(torch.randn_like(buffer) * 0.05)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path, case):
    path = str(tmp_path / case)
    assert_greedy_matches(path, build_checkpoint(path, case))


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_logits_close_to_float32(tmp_path, case):
    path = str(tmp_path / case)
    build_checkpoint(path, case)
    assert_bfloat16_logits_close(path, routed=CASES[case][3])


@pytest.mark.parametrize(
    "kv_cache_dtype,quantization,mean_err", [("int8", None, 0.03), ("fp8", "int8", 0.15)]
)
def test_latent_cache_quantized(tmp_path, kv_cache_dtype, quantization, mean_err):
    """MLA's latent cache in int8 / fp8, and int8 weights (kv_b_proj stays float: it is absorbed): prompt
    logprobs of chunked prompts (later chunks read the quantized cache) near the float32 engine's, on
    average (random tiny models flip greedy tokens at the smallest change), nothing leaked."""
    from perfxlm import LLM, SamplingParams
    from tests.conftest import assert_pool_whole
    from tests.model.test_architectures_vs_hf import _prompts

    path = str(tmp_path / "ds")
    build_checkpoint(path, "deepseekv3-noaux-grouped")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[2:]]

    def prompt_logprobs(llm) -> torch.Tensor:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return torch.tensor([next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]])

    ref = prompt_logprobs(LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64))
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization,
              max_num_batched_tokens=16)  # fmt: skip
    err = (prompt_logprobs(llm) - ref).abs()
    assert 0 < err.mean().item() < mean_err
    assert_pool_whole(llm)


@pytest.mark.parametrize("field,value,named", [
    ("topk_method", "sparse_sinkhorn", "topk_method 'sparse_sinkhorn'"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
     "rope scaling type 'dynamic'"),
])  # fmt: skip
def test_unsupported_deepseek_variant_named_at_load(tmp_path, field, value, named):
    from perfxlm import LLM

    config = transformers.DeepseekV2Config(**{**COMMON, **CASES["deepseekv2-grouped-qlora"][2]})
    setattr(config, field, value)
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=named + r".*supported"):
        LLM(str(tmp_path), skip_tokenizer_init=True, load_format="dummy")


@pytest.mark.parametrize("case,quantization_config", [
    ("gptoss-sinks-alternating", {"quant_method": "hqq", "modules_to_not_convert": []}),  # mxfp4 loads
    ("deepseekv3-noaux-grouped", {"quant_method": "bitsandbytes", "load_in_4bit": True}),  # fp8 loads
])  # fmt: skip
def test_quantized_checkpoint_formats_refused_before_weights(tmp_path, case, quantization_config):
    import json

    from perfxlm import LLM

    path = tmp_path / case
    build_checkpoint(str(path), case)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"not read")  # the refusal comes before any weight
    method = quantization_config["quant_method"]
    with pytest.raises(ValueError, match=rf"quant_method='{method}' is not supported; supported: awq"):
        LLM(str(path), skip_tokenizer_init=True)


def test_latent_cache_holds_the_latent_once(tmp_path):
    """A DeepSeek layer's KV cache is one [latent | rope key] tensor serving as K and V: bytes per token
    are kv_lora_rank + qk_rope_head_dim values per layer, not the expanded heads' K and V."""
    from perfxlm import LLM

    path = str(tmp_path / "ds")
    build_checkpoint(path, "deepseekv2-lite-yarn")
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)
    core = llm.llm_engine.core
    caches = [m.attn.kv_cache for m in core.model.modules() if hasattr(m, "latent_dim")]
    assert len(caches) == 3 and all(c.value is c.key for c in caches)
    c = CASES["deepseekv2-lite-yarn"][2]
    latent = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    assert core.kv_bytes_per_block == 3 * 16 * latent * 4  # 3 layers, 16 tokens a block, float32
    expanded = c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
    assert expanded / latent > 3.5  # 170 against 44 values per token and layer here


@pytest.mark.parametrize("case", ["deepseekv2-lite-yarn", "gptoss-sinks-alternating"])
def test_preemption_and_parallel_samples(tmp_path, case):
    """A pool too small for the batch (requests preempted and recomputed) and n = 2 (forked blocks, a
    partial one copied: for MLA, the one tensor that is K and V): the same greedy tokens as a roomy pool."""
    from perfxlm import LLM, SamplingParams
    from tests.conftest import assert_pool_whole
    from tests.model.test_architectures_vs_hf import _prompts

    path = str(tmp_path / case)
    build_checkpoint(path, case)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[1:]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    roomy = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    tight = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=12, block_size=8)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(a == b for a, b in want)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert_pool_whole(tight)


def test_qwen3moe_gguf_matches_transformers(tmp_path, monkeypatch):
    """A qwen3moe GGUF file as llama.cpp's converter writes one (expert stacks `ffn_*_exps` [E, rows, cols]
    in Q8_0, kept quantized; the rest F32) against transformers on the same, dequantized, weights."""
    import gguf
    import numpy as np

    from perfxlm import LLM
    from tests.model.test_architectures_vs_hf import _prompts, assert_generate_matches_hf

    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # quantized products equal to float ones
    Q = gguf.GGMLQuantizationType
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**COMMON, **dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=False, rope_theta=10000.0,
    )})  # fmt: skip
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    hf.set_experts_implementation("eager")
    path = str(tmp_path / "qwen3moe.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in [("block_count", 2), ("context_length", 512), ("embedding_length", 64),
                       ("feed_forward_length", 96), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2), ("attention.key_length", 32),
                       ("attention.value_length", 32), ("expert_count", 5), ("expert_used_count", 2),
                       ("expert_feed_forward_length", 32)]:  # fmt: skip
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.rope.freq_base", 10000.0)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))

    def add(name: str, hf_name: str, value: torch.Tensor, qtype=Q.F32) -> None:
        data = value.float().numpy()
        if qtype != Q.F32:
            data = gguf.quants.quantize(data, qtype)
            value = torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        writer.add_tensor(name, data, raw_dtype=qtype)
        state[hf_name] = value.reshape(state[hf_name].shape) if hf_name in state else value

    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    add("token_embd.weight", "model.embed_tokens.weight", state["model.embed_tokens.weight"])
    add("output.weight", "lm_head.weight", state["lm_head.weight"])
    add("output_norm.weight", "model.norm.weight", state["model.norm.weight"])
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}  # fmt: skip
    for i in range(2):
        for part, hf_part in parts.items():
            hf_name = f"model.layers.{i}.{hf_part}.weight"
            add(f"blk.{i}.{part}.weight", hf_name, state[hf_name])
        experts = f"model.layers.{i}.mlp.experts"
        gate_up = state[f"{experts}.gate_up_proj"]
        gate, up = gate_up[:, :32].clone(), gate_up[:, 32:].clone()
        for part, value in (("gate", gate), ("up", up)):
            add(f"blk.{i}.ffn_{part}_exps.weight", f"{experts}.{part}", value, Q.Q8_0)
        add(f"blk.{i}.ffn_down_exps.weight", f"{experts}.down_proj", state[f"{experts}.down_proj"], Q.Q8_0)
        halves = (state.pop(f"{experts}.gate"), state.pop(f"{experts}.up"))
        state[f"{experts}.gate_up_proj"] = torch.cat(halves, 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf.load_state_dict(state)

    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    experts = llm.llm_engine.core.model.model.layers[0].mlp.experts
    assert not isinstance(experts.gate_up_proj, torch.Tensor)  # kept as Q8_0 blocks, not widened
    prompts = _prompts(seed=2)
    assert_generate_matches_hf(llm, hf, prompts, atol=2e-4)


def test_gemma3_gguf_matches_transformers(tmp_path):
    """A gemma3 GGUF file as llama.cpp's converter writes one (norms stored as 1 + w, q/k norms included;
    the global rope base and its linear scaling in the metadata, the local base and the 5:1 pattern
    implied) against transformers."""
    import gguf

    from perfxlm import LLM
    from tests.model.test_architectures_vs_hf import _prompts, assert_generate_matches_hf

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{**COMMON, **dict(
        hidden_size=48, intermediate_size=72, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=9,
        initializer_range=0.05, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )})  # fmt: skip
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    path = str(tmp_path / "gemma3.gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    for key, value in [("block_count", 7), ("context_length", 512), ("embedding_length", 48),
                       ("feed_forward_length", 72), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2), ("attention.key_length", 16),
                       ("attention.value_length", 16), ("attention.sliding_window", 9)]:  # fmt: skip
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.rope.freq_base", 50000.0)
    writer.add_string("gemma3.rope.scaling.type", "linear")
    writer.add_float32("gemma3.rope.scaling.factor", 4.0)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        t = tensor.detach().float()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        if name.endswith("norm.weight"):
            t = t + 1  # the converter's norm_shift
        writer.add_tensor(gguf_name, t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    prompts = _prompts(seed=3)
    assert_generate_matches_hf(llm, hf, prompts, atol=2e-4)
