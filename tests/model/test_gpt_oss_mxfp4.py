"""gpt-oss with MXFP4 experts. GGUF files as llama.cpp's converter writes them (`benchmarks/make_dummy_gguf.py`'s `write_gpt_oss`:
MXFP4 expert stacks split into gate / up, attention sinks, YaRN, alternating windows) against transformers
on the same weights (the MXFP4 values dequantized into its float32 model): greedy output token-identical,
the experts kept packed; the same for the Hugging Face checkpoint's MXFP4 (`*_blocks` / `*_scales`). And what
must fail loudly: a tensor type the loader cannot read, a checkpoint whose packing disagrees with itself."""

from __future__ import annotations

import os
import struct

import gguf
import numpy as np
import pytest
import torch
import transformers

from perfxlm import LLM
from perfxlm.quant.weight import QuantizedWeight
from tests.model.dummy_gguf import converter
from tests.model.test_architectures_vs_hf import COMMON, _generate, _prompts, assert_generate_matches_hf

pytestmark = pytest.mark.usefixtures("one_thread")



def build_gpt_oss(seed: int = 0, **overrides) -> transformers.GptOssForCausalLM:
    """Odd sizes where MXFP4 allows them (rows of the stacks are whole blocks of 32): 5 heads of 24 over
    one KV head, 5 experts, 2 chosen, a window of 7, YaRN; swiglu_limit is the 7.0 the file implies.
    `overrides`: config fields changed (the tensor-parallel test's heads)."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**COMMON, **dict(
        vocab_size=997, hidden_size=96, intermediate_size=64, num_hidden_layers=3, num_attention_heads=5,
        num_key_value_heads=1, head_dim=24, sliding_window=7, num_local_experts=5, num_experts_per_tok=2,
        tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 15000.0},
    ), **overrides})  # fmt: skip
    model = transformers.GptOssForCausalLM(config).eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * 2)
            elif name.endswith("gate_up_proj"):
                param.mul_(6)  # activations past the clamp of 7.0 on some rows
            elif param.ndim == 1 or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.parametrize("float_type", ["F32", "BF16"])
def test_gpt_oss_mxfp4_gguf_matches_transformers(tmp_path, monkeypatch, float_type):
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")  # the packed products equal float ones
    hf = build_gpt_oss()
    path = str(tmp_path / "gpt-oss.gguf")
    hf.load_state_dict(converter().write_gpt_oss(path, hf, float_type))  # the values the file holds

    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    experts = llm.llm_engine.core.model.model.layers[1].mlp.experts
    for stack in (experts.gate_up_proj, experts.down_proj):
        assert isinstance(stack, QuantizedWeight) and stack.bits == 4  # kept as MXFP4 codes, not widened
    assert "mxfp4" in experts.gate_up_proj.describe()
    prompts = _prompts(seed=3, vocab=997)
    tokens = assert_generate_matches_hf(llm, hf, prompts)
    assert len(set(tokens[-1])) > 4  # random enough that greedy output varies


def test_gpt_oss_gguf_with_yarn_beyond_gpt_oss_is_refused(tmp_path):
    """YaRN is read only for gpt-oss: a llama file that asks for it names the value and what is read."""
    from tests.model.test_gguf_vs_hf import build_hf, write_converted

    path = str(tmp_path / "llama-yarn.gguf")
    write_converted(path, build_hf("llama-tied-mha"), "llama",
                    extra_meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})  # fmt: skip
    with pytest.raises(ValueError, match=r"rope scaling type 'yarn' is not supported for architecture 'llama'"):
        LLM(path, skip_tokenizer_init=True, dtype="float32")


def _set_tensor_type(path: str, name: str, type_id: int) -> None:
    """Rewrite the GGML type of tensor `name` in the file's header (the data left as it is)."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    # a tensor info record: name, n_dims (uint32), dims (uint64 each), type (uint32), offset (uint64)
    raw = open(path, "rb").read()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", raw, type_at)[0] == int(tensor.tensor_type)
    with open(path, "r+b") as f:
        f.seek(type_at)
        f.write(struct.pack("<I", type_id))


@pytest.mark.parametrize("type_id,named", [
    (99, "unknown GGML type 99"),  # no GGML type at all
    (int(gguf.GGMLQuantizationType.Q8_1), r"GGML tensor type Q8_1 is not supported \(supported: .*MXFP4"),
])  # fmt: skip
def test_unknown_or_unreadable_ggml_type_is_a_clear_error(tmp_path, type_id, named):
    hf = build_gpt_oss()
    path = str(tmp_path / "bad.gguf")
    converter().write_gpt_oss(path, hf)
    _set_tensor_type(path, "blk.0.attn_sinks.weight", type_id)
    with pytest.raises(ValueError, match=named):
        LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)


def _mxfp4_checkpoint(folder, hf, quantization_config=None, corrupt: str | None = None) -> dict:
    """Save `hf` as OpenAI's gpt-oss checkpoints store it: expert stacks as `*_blocks` / `*_scales`
    (rounded by ggml's MXFP4 rule), the rest float, and `quantization_config` naming mxfp4. Returns the
    stacks' values in transformers' layout, as the checkpoint holds them. `corrupt`: a tensor to cut short."""
    import json

    from safetensors.torch import load_file, save_file

    from perfxlm.quant import mxfp4

    hf.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    held = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).transpose(1, 2)  # [E, out, in]
        blocks, scales = mxfp4.quantize_reference(w)
        if corrupt and name.endswith(corrupt):
            scales = scales[..., :-1].contiguous()
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        held[name] = mxfp4.from_checkpoint(blocks, scales, name).dequantize().transpose(1, 2) if not corrupt else w
    save_file(state, path, metadata={"format": "pt"})
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config or {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }  # fmt: skip
    with open(config_path, "w") as f:
        json.dump(config, f)
    return held


def test_gpt_oss_mxfp4_checkpoint_matches_transformers(tmp_path):
    hf = build_gpt_oss(seed=1)
    folder = str(tmp_path / "gpt-oss-mxfp4")
    held = _mxfp4_checkpoint(folder, hf)
    hf.load_state_dict(held, strict=False)  # transformers on the values the checkpoint holds

    llm = LLM(folder, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    experts = llm.llm_engine.core.model.model.layers[2].mlp.experts
    assert isinstance(experts.down_proj, QuantizedWeight) and experts.down_method.name == "mxfp4"
    assert tuple(experts.gate_up_proj.shape) == (5, 128, 96)  # [E, 2 * inter, hidden]: packed as stored
    prompts = _prompts(seed=4, vocab=997)[1:]
    assert_generate_matches_hf(llm, hf, prompts)


@pytest.mark.parametrize("quantization_config,corrupt,named", [
    ({"quant_method": "mxfp4", "group_size": 64}, None, r"field\(s\) group_size for mxfp4 are not supported"),
    (None, "down_proj", r"'model.layers.0.mlp.experts.down_proj_blocks' .* and .*_scales' .* do not fit"),
])  # fmt: skip
def test_bad_mxfp4_checkpoints_are_refused_before_weights_are_read(tmp_path, quantization_config, corrupt, named):
    folder = str(tmp_path / "bad")
    _mxfp4_checkpoint(folder, build_gpt_oss(), quantization_config, corrupt)
    with pytest.raises(ValueError, match=named):
        LLM(folder, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)


def test_gpt_oss_gguf_int8_activations_in_the_kernel_equal_torch_rounding(tmp_path, monkeypatch):
    """quant_activations='int8': the expert kernel looks the E2M1 table up as int8 and dots it with the
    int8 activation blocks (where the build has int8 dots); the same model with the blocks rounded in
    torch and multiplied in float gives the same tokens and logprobs to float rounding."""
    from perfxlm.model.layers.linear_methods import quantized
    from perfxlm.ops import fused_moe
    from perfxlm.ops.linear import native_int8_blocks

    path = str(tmp_path / "gpt-oss.gguf")
    converter().write_gpt_oss(path, build_gpt_oss(seed=2))
    prompts = _prompts(seed=5, vocab=997)[1:]
    runs = []
    for kernel_rounds in (True, False):
        if not kernel_rounds:  # what a build without int8 dots does: torch rounds, the float kernel multiplies
            monkeypatch.setattr(fused_moe, "native_int8_blocks", lambda w: False)
            monkeypatch.setattr(quantized, "native_int8_blocks", lambda w: False)
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", quant_activations="int8", num_kv_blocks=64)
        experts = llm.llm_engine.core.model.model.layers[0].mlp.experts
        if kernel_rounds:
            assert experts.gate_up_method.int8_blocks == native_int8_blocks(experts.gate_up_proj)
        runs.append(_generate(llm, prompts))
    (tokens, logprobs), (want_tokens, want_logprobs) = runs
    assert tokens == want_tokens
    for got_lp, want_lp in zip(logprobs, want_logprobs):
        np.testing.assert_allclose(got_lp, want_lp, atol=2e-3, rtol=0)
