"""DeepSeek-V2 / V3 GGUF files (llama.cpp's `deepseek2`), written from random-weight transformers models as
llama.cpp's converter lays them out (`benchmarks/make_dummy_gguf.py`'s `write_deepseek2`): greedy float32
output token-identical to transformers on the values the file holds, F32 and quantized, kv_b split into
attn_k_b / attn_v_b or whole; metadata the loader cannot honour refused by name."""

from __future__ import annotations

import gguf
import pytest
import torch
import transformers

from perfxlm import LLM
from perfxlm.quant.weight import QuantizedWeight
from tests.model.dummy_gguf import converter
from tests.model.test_architectures_vs_hf import (
    COMMON,
    _prompts,
    assert_generate_matches_hf,
    assert_greedy_matches,
)
from tests.model.test_recent_families_vs_hf import CASES, perturb

pytestmark = pytest.mark.usefixtures("one_thread")



# rows that are whole 32-value blocks where a test quantizes (hidden 64, kv_lora 32, q_lora 32), odd ones
# elsewhere (nope 12, v 14, expert intermediate 40: those stay F32 in a quantized file, as converted)
QUANTIZABLE = {
    "deepseekv2-lite-yarn": dict(hidden_size=64, kv_lora_rank=32, intermediate_size=96, moe_intermediate_size=40,
                                 num_attention_heads=4, num_key_value_heads=4),
    "deepseekv3-noaux-grouped": dict(hidden_size=64, kv_lora_rank=32, q_lora_rank=32, intermediate_size=96,
                                     moe_intermediate_size=40),
}  # fmt: skip


def build(case: str, quantizable: bool = False, seed: int = 0):
    config_cls, model_cls, overrides, _ = CASES[case]
    torch.manual_seed(seed)
    over = {**overrides, **(QUANTIZABLE[case] if quantizable else {})}
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **over})).eval()
    model.set_experts_implementation("eager")
    perturb(model)
    return model


@pytest.mark.parametrize("case,split", [
    ("deepseekv2-lite-yarn", True),  # no query bottleneck, YaRN with mscale, softmax greedy, a dense layer
    ("deepseekv2-grouped-qlora", True),  # the query bottleneck, group-limited softmax routing (3 groups)
    ("deepseekv3-noaux-grouped", False),  # sigmoid + correction bias, groups, renormalised; attn_kv_b whole
])  # fmt: skip
def test_deepseek_gguf_matches_transformers(tmp_path, case, split):
    hf = build(case)
    path = str(tmp_path / "ds.gguf")
    hf.load_state_dict(converter().write_deepseek2(path, hf, "F32", split_kv_b=split))
    assert_greedy_matches(path, hf)


@pytest.mark.parametrize("case,qtype", [("deepseekv3-noaux-grouped", "Q8_0"), ("deepseekv2-lite-yarn", "Q4_0")])
def test_quantized_deepseek_gguf_kept_quantized(tmp_path, monkeypatch, case, qtype):
    """Q8_0 / Q4_0 matrices (experts, shared experts, attention, the split kv_b) kept as blocks and equal to
    transformers on the dequantized values, greedy (products in float32)."""
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")
    hf = build(case, quantizable=True)
    path = str(tmp_path / "ds.gguf")
    hf.load_state_dict(converter().write_deepseek2(path, hf, qtype))
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    layer = llm.llm_engine.core.model.model.layers[1]
    assert isinstance(layer.mlp.experts.gate_up_proj, QuantizedWeight)  # [E, 2 x 40, 64]: rows of 64
    assert isinstance(layer.self_attn.kv_a_proj_with_mqa.weight, QuantizedWeight)
    assert isinstance(layer.self_attn.kv_b_proj.weight, torch.Tensor)  # absorbed: float
    assert_generate_matches_hf(llm, hf, _prompts(seed=3), atol=2e-4)


@pytest.mark.parametrize("case,arch", [("deepseekv3-noaux-grouped", "DeepseekV3ForCausalLM"),
                                       ("deepseekv2-grouped-qlora", "DeepseekV2ForCausalLM")])
def test_deepseek_gguf_config(tmp_path, case, arch):
    """The config read back: the heads' own sizes (not the MQA view), the family and its routing."""
    from perfxlm.model.loader.gguf import load_gguf_config

    hf = build(case)
    path = str(tmp_path / "ds.gguf")
    converter().write_deepseek2(path, hf, "F32")
    c, want = load_gguf_config(path), hf.config
    assert c.architectures == [arch]
    assert c.topk_method == getattr(want, "topk_method", "noaux_tc")  # V3's config has no field: noaux_tc
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "n_group",
                "topk_group", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace",
                "moe_intermediate_size", "norm_topk_prob", "num_attention_heads"):  # fmt: skip
        assert getattr(c, key) == getattr(want, key), key
    assert c.routed_scaling_factor == pytest.approx(want.routed_scaling_factor)


@pytest.mark.parametrize("key,value,named", [
    ("deepseek2.expert_gating_func", 3, "expert_gating_func=3 is not supported"),
    ("deepseek2.rope.scaling.type", "longrope", "rope scaling type 'longrope'"),
])  # fmt: skip
def test_deepseek_gguf_unsupported_metadata_named(tmp_path, key, value, named):
    """A key the converter wrote, changed to a value the loader does not read."""
    hf = build("deepseekv2-lite-yarn")
    path = str(tmp_path / "ds.gguf")
    conv = converter()
    original = gguf.GGUFWriter.write_kv_data_to_file

    def with_key(self):  # the converter's file, one key changed
        self.kv_data[0].pop(key, None)
        kind = gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.get_type(value)
        self.kv_data[0][key] = gguf.GGUFValue(value, kind)
        return original(self)

    gguf.GGUFWriter.write_kv_data_to_file = with_key
    try:
        conv.write_deepseek2(path, hf, "F32")
    finally:
        gguf.GGUFWriter.write_kv_data_to_file = original
    with pytest.raises(ValueError, match=named):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)


def test_deepseek_gguf_softmax_renormalised_refused(tmp_path):
    """DeepSeek-V2's softmax weights are never renormalised; a file that asks for it is refused by name."""
    hf = build("deepseekv2-lite-yarn")
    hf.config.norm_topk_prob = True
    path = str(tmp_path / "ds.gguf")
    converter().write_deepseek2(path, hf, "F32")
    with pytest.raises(ValueError, match="expert_weights_norm=true with softmax gating is not supported"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)
