"""GGUF files laid out as llama.cpp's converter (convert_hf_to_gguf.py) writes them, against transformers
on the Hugging Face model they were converted from: greedy float32 output token-identical.

The converter's conventions reproduced here: Llama (and Mistral, which it writes as `llama`) q/k rows
permuted for llama.cpp's rope layout; Llama-3.x rope scaling stored only as the per-frequency
`rope_freqs` tensor; an explicit head_dim as attention.key_length/value_length; a tied LM head as no
`output` tensor. And what must fail loudly rather than load: unknown metadata, rope scaling and tensors.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import transformers

from perfxlm import LLM
from perfxlm.model.loader.gguf import load_gguf_config
from tests.model.test_architectures_vs_hf import _prompts, assert_generate_matches_hf, hf_greedy_with_logprobs

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small, so that the scaled and blended frequencies matter at short test positions
               "original_max_position_embeddings": 64}  # fmt: skip

# name -> (config class, model class, GGUF architecture, config overrides)
# fmt: off
CASES = {
    "llama3-rope-scaling-untied": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
    )),
    "llama-tied-mha": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    )),
    "qwen2-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True, rope_parameters={"rope_theta": 1000000.0},
    )),
    # Mistral-Nemo's shape: head_dim (32) is not hidden_size / heads (16); the converter writes it as llama
    "mistral-explicit-head-dim": ("MistralConfig", "MistralForCausalLM", "llama", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=4096, sliding_window=None, tie_word_embeddings=False,
    )),
    # attention scale from head_dim as llama.cpp derives it (the file cannot carry query_pre_attn_scalar)
    "gemma2-softcap-local-global": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=12, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, max_position_embeddings=8192, initializer_range=0.02,
    )),
    # GLM-4-0414: four norms a layer, fused gate|up as ffn_up, q/k/v biases, interleaved rotary over 10 of
    # each head's 20 channels (rope.dimension_count is that width; key_length the head size)
    "glm4-partial-post-norms": ("Glm4Config", "Glm4ForCausalLM", "glm4", dict(
        hidden_size=60, intermediate_size=92, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=20, partial_rotary_factor=0.5, attention_bias=True, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )),
}
# fmt: on

_TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
_GEMMA2_NORMS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


def build_hf(case: str, seed: int = 0):
    config_cls, model_cls, _, overrides = CASES[case]
    torch.manual_seed(seed)
    defaults = dict(vocab_size=1000, initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    rms_norm_eps=1e-5)  # fmt: skip
    config = getattr(transformers, config_cls)(**{**defaults, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms and biases start at constants: perturb them so they count
                param.add_(torch.randn_like(param) * 0.1)
            if case.startswith("gemma2") and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)  # attention scores large enough that the soft cap bends them
    return model


def converter_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rows of each head reordered for llama.cpp's rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converter_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3 (rope_freqs)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_converted(path: str, model, arch: str, extra_meta: dict | None = None, extra_tensors: dict | None = None,
                    q8_0: tuple[str, ...] = (), qtype: int = gguf.GGMLQuantizationType.Q8_0):
    """`q8_0`: suffixes of the HF tensors written as `qtype` blocks (Q8_0 unless told; the rest F32)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    # the converter's Glm4Model: the rotary width, head_dim x partial_rotary_factor
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 0.5)) if arch == "glm4" else head_dim
    meta = {f"{arch}.{k}": v for k, v in [
        ("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
        ("block_count", cfg.num_hidden_layers), ("feed_forward_length", cfg.intermediate_size),
        ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
        ("rope.dimension_count", rotary_dim), ("vocab_size", cfg.vocab_size),
        ("rope.freq_base", float(rope.get("rope_theta", 10000.0))),
        ("attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps)),
    ]}  # fmt: skip
    if head_dim != cfg.hidden_size // heads or arch == "gemma2":
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = head_dim
    if arch == "gemma2":  # the converter's Gemma2Model: no rope keys, soft-caps and the window instead
        del meta[f"{arch}.rope.dimension_count"], meta[f"{arch}.rope.freq_base"]
        meta[f"{arch}.attn_logit_softcapping"] = float(cfg.attn_logit_softcapping)
        meta[f"{arch}.final_logit_softcapping"] = float(cfg.final_logit_softcapping)
        meta[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    if rope.get("rope_type") == "linear":  # the converter's add_rope_scaling_type / _factor
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(rope["factor"])
    meta["general.file_type"] = 0  # all F32
    meta.update(extra_meta or {})  # a test's keys replace the converter's
    writer = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", converter_rope_factors(head_dim, rope["rope_theta"], rope))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the converter writes no output tensor
        if "rotary_emb" in name:
            continue
        t = tensor.detach().float()
        if name in _TENSOR_NAMES:
            gguf_name = _TENSOR_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            names = {**_LAYER_NAMES, **_GEMMA2_NORMS} if arch == "gemma2" else _LAYER_NAMES
            if arch == "glm4":  # gguf's own name map, as the converter uses it
                gguf_name = gguf.TensorNameMap(gguf.MODEL_ARCH.GLM4, cfg.num_hidden_layers).get_name(name[: -len(kind) - 1])
                gguf_name = f"{gguf_name}.{kind}"
            else:
                gguf_name = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                t = converter_permute(t, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                t = converter_permute(t, kv_heads)
        if arch == "gemma2" and name.endswith("norm.weight"):
            t = t + 1  # the converter stores Gemma norms as (1 + w)
        if name.endswith(q8_0):
            writer.add_tensor(gguf_name, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
            continue
        writer.add_tensor(gguf_name, t.numpy())
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case", list(CASES))
def test_converted_gguf_matches_transformers(tmp_path, case):
    hf = build_hf(case)
    path = str(tmp_path / f"{case}.gguf")
    write_converted(path, hf, CASES[case][2])
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    prompts = _prompts(seed=2)
    tokens = assert_generate_matches_hf(llm, hf, prompts)
    assert len(set(tokens[-1])) > 4  # random enough that greedy output varies


def test_llama3_rope_freqs_are_applied_and_matter(tmp_path):
    hf = build_hf("llama3-rope-scaling-untied")
    path = str(tmp_path / "llama3.gguf")
    write_converted(path, hf, "llama")
    config = load_gguf_config(path)
    assert config.rope_freq_factors is not None and len(config.rope_freq_factors) == 8
    # the same weights with plain rope answer differently: the test above would catch a dropped tensor
    plain = build_hf("llama3-rope-scaling-untied")
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    plain.model.rotary_emb = type(plain.model.rotary_emb)(plain.config)
    prompt = _prompts(seed=2)[-1]
    assert hf_greedy_with_logprobs(plain, prompt, 16)[0] != hf_greedy_with_logprobs(hf, prompt, 16)[0]


def test_llama_with_a_sliding_window_loads_as_mistral(tmp_path):
    hf = build_hf("mistral-explicit-head-dim")
    path = str(tmp_path / "swa.gguf")
    write_converted(path, hf, "llama", extra_meta={"llama.attention.sliding_window": 12})
    config = load_gguf_config(path)
    assert config.architectures == ["MistralForCausalLM"] and config.sliding_window == 12
    assert config.head_dim == 32


# ---------------------------------------------------------------------------------------------------------
# What must not load silently
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("meta,match", [
    ({"llama.attn_logit_softcapping": 50.0}, r"llama.attn_logit_softcapping is not supported"),
    ({"llama.final_logit_softcapping": 30.0}, r"llama.final_logit_softcapping is not supported"),
    ({"llama.attention.scale": 0.5}, r"attention.scale=0.5 differs"),
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, r"rope scaling type 'longrope'"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, r"rope scaling type 'yarn'"),
    ({"llama.rope.scaling.attn_factor": 1.2}, r"attn_factor=1.2 is not supported"),
    ({"llama.expert_count": 8, "llama.expert_used_count": 2}, r"mixture-of-experts"),
    ({"llama.embedding_scale": 12.0}, r"llama.embedding_scale is not supported"),
    ({"llama.attention.head_count_kv": [2, 4]}, r"differs between layers"),
])  # fmt: skip
def test_untranslated_metadata_fails_loudly(tmp_path, meta, match):
    hf = build_hf("llama-tied-mha")
    path = str(tmp_path / "bad.gguf")
    write_converted(path, hf, "llama", extra_meta=meta)
    with pytest.raises(ValueError, match=match):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)


def test_matching_attention_scale_and_uniform_per_layer_lists_load(tmp_path):
    hf = build_hf("llama-tied-mha")
    path = str(tmp_path / "ok.gguf")
    write_converted(path, hf, "llama",
                    extra_meta={"llama.attention.scale": 16**-0.5, "llama.attention.head_count_kv": [4, 4]})
    config = load_gguf_config(path)
    assert config.num_key_value_heads == 4


def test_unknown_tensor_fails_loudly(tmp_path):
    hf = build_hf("llama-tied-mha")
    path = str(tmp_path / "moe.gguf")
    write_converted(path, hf, "llama", extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4, 64), np.float32)})
    with pytest.raises(ValueError, match=r"blk.0.ffn_gate_exps.weight.*no counterpart"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)


def test_unsupported_gguf_architecture_is_refused_with_a_clear_error(tmp_path):
    path = str(tmp_path / "gemma3n.gguf")
    writer = gguf.GGUFWriter(path, "gemma3n")
    for key, value in [("block_count", 2), ("embedding_length", 64), ("attention.head_count", 4)]:
        writer.add_uint32(f"gemma3n.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((1000, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gemma3n' is not supported \(supported: deepseek2, gemma2, gemma3, glm4, gpt-oss, llama"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)



def test_glm4_q8_0_projections_stay_quantized(tmp_path, monkeypatch):
    """A glm4 file with Q8_0 projections: kept as blocks (the q/k rows reordered for the interleaved
    rotary by moving whole rows of codes and scales), against transformers on the same dequantized
    weights."""
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # quantized products equal to float ones
    q8 = gguf.GGMLQuantizationType.Q8_0
    torch.manual_seed(3)
    config = transformers.Glm4Config(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
        max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.15, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    hf = transformers.Glm4ForCausalLM(config).eval()
    suffixes = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_up_proj.weight",
                "down_proj.weight")  # fmt: skip
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(suffixes):  # the values Q8_0 holds, so both models compute with the same
                blocks = gguf.quants.quantize(param.numpy(), q8)
                param.copy_(torch.from_numpy(np.array(gguf.quants.dequantize(blocks, q8))).view_as(param))
    path = str(tmp_path / "glm4-q8.gguf")
    write_converted(path, hf, "glm4", q8_0=suffixes)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    attn = llm.llm_engine.core.model.model.layers[0].self_attn
    assert not isinstance(attn.qkv_proj.weight, torch.Tensor)  # kept as Q8_0 codes, not widened
    prompts = _prompts(seed=2)
    assert_generate_matches_hf(llm, hf, prompts)
