"""Quantized weights through the engine: every format on a tiny Llama and MoE checkpoints (greedy output
equal to the same model with the dequantized weights in float32), every family with int8, GGUF files
kept quantized (q/k rows un-permuted, tied head sharing the table), prefix caching / n > 1 / preemption,
the default model (kept quantized, same text as the dequantized path, resident memory near the file
size), and the errors raised before any weight is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.model.layers.embed_head import VocabEmbedding
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.ops import native
from perfxlm.quant import QuantizationConfig, QuantizedWeight
from perfxlm.quant.mixed import layer_of, use_more_bits
from tests.conftest import assert_pool_whole, make_llama_checkpoint
from tests.model.test_architectures_vs_hf import CASES, build_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [50, 60, 70], list(range(100, 140))]
FORMATS = {
    "int8": "int8",
    "int8-g32-asym": {"method": "int8", "group_size": 32, "symmetric": False},
    "int4": "int4",
    "int4-sym": {"method": "int4", "symmetric": True},
    "int4-uniform": {"method": "int4", "mixed_precision": False, "calibration": False},
    "nf4-g32": {"method": "nf4", "group_size": 32},
    "nf4-g32-plain": {"method": "nf4", "group_size": 32, "double_quant": False},
    "w8a8": "w8a8",
    # float tables here (`lm_head: false`): the per-token rounding of native and reference kernels parts
    # on a random Mixtral's near-tied logits once the head is 8-bit as well
    "w8a8-per-token": {"method": "w8a8", "activation_group_size": -1, "lm_head": False},
}


@pytest.fixture(autouse=True)
def _exact_products(monkeypatch):
    """Float32 products for weight-only formats (quant_activations left at auto reads the environment:
    no int8 activation blocks) and one thread (tiny models)."""
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama128(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama128"))
    return make_llama_checkpoint(path, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mixtral"))
    build_checkpoint(path, "mixtral-sliding")
    return path


def model_of(llm):
    return llm.llm_engine.core.model


def quantized_weights(model) -> dict[str, QuantizedWeight]:
    return {f"{name}.{attr}": v for name, m in model.named_modules() for attr, v in vars(m).items()
            if isinstance(v, QuantizedWeight)}  # fmt: skip


def dequantized_twin(qllm, path: str):
    """The same checkpoint in float32 with every quantized weight replaced by its dequantized values."""
    twin = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    modules = dict(model_of(twin).named_modules())
    for name, w in quantized_weights(model_of(qllm)).items():
        parent, attr = name.rsplit(".", 1)
        getattr(modules[parent], attr).data.copy_(w.dequantize())
    return twin


def generate(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


def assert_same_greedy(a, b, atol=2e-3):
    (ta, la), (tb, lb) = a, b
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("checkpoint", ["llama128", "mixtral"])
def test_format_end_to_end(fmt, checkpoint, request, monkeypatch):
    path = request.getfixturevalue(checkpoint)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, quantization=FORMATS[fmt])
    model = model_of(llm)
    weights = quantized_weights(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, Linear) and m.quantize_weight]
    assert {f"{n}.weight" for n in linears} <= set(weights)
    experts = [n for n, m in model.named_modules() if isinstance(m, FusedMoE)]
    assert all(f"{n}.gate_up_proj" in weights and weights[f"{n}.down_proj"].num_experts for n in experts)
    assert (len(experts) > 0) == (checkpoint == "mixtral")
    routers = [m for m in model.modules() if isinstance(m, Linear) and not m.quantize_weight]
    assert all(isinstance(m.weight, torch.nn.Parameter) for m in routers)  # routers stay float
    tables = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    if not isinstance(FORMATS[fmt], dict) or FORMATS[fmt].get("lm_head", True):  # quantized tables by default
        config = QuantizationConfig.resolve(FORMATS[fmt])
        mixed = config.mixed_precision
        untied = model.lm_head.weight is not tables[0].weight
        # 8-bit codes per 64 (int4: 6-bit, a float16 scale per 32 on these widths, not whole 256s)
        table_form = (8, 64) if config.head_bits == 8 else (6, 32)
        # mixed precision: a table only looked up takes 4-bit codes (Q4_K_M's token_embd: Q4_K)
        assert tables and all((m.weight.bits == 4) if mixed and untied else (m.weight.bits, m.weight.group) == table_form
                              for m in tables)  # fmt: skip
        assert model.lm_head.weight.bits == config.head_bits
    else:
        assert tables and all(isinstance(m.weight, torch.nn.Parameter) for m in tables)
    acts = {"w8a8": "int8_block", "w8a8-per-token": "int8"}
    assert all(w.act == ("float" if "embed" in n or "lm_head" in n else acts.get(fmt, "float")) for n, w in weights.items())
    got = generate(llm)
    if fmt in acts:
        # activations quantized at run time: the native kernels against the torch reference. An
        # activation within float rounding of a half quantizes to the next int8 in one of them (which
        # one depends on the tier's summation order), and from that step on the two runs differ by up
        # to 1 / 127 of that activation's share: seen 0.10 on one AVX512-VNNI step of this tiny random
        # model. So: the same tokens, most logprobs equal to float rounding (a wrong kernel moves them
        # all), none far off.
        monkeypatch.setattr(native, "kernels", lambda: None)
        ref = generate(llm)
        assert got[0] == ref[0]
        diffs = np.abs(np.concatenate([np.subtract(x, y) for x, y in zip(got[1], ref[1])]))
        assert np.median(diffs) < 2e-3 and diffs.max() < 0.25, diffs
    else:  # weight-only: the float model holding the dequantized weights, up to summation order
        assert_same_greedy(got, generate(dequantized_twin(llm, path)))
    assert_pool_whole(llm)


@pytest.mark.parametrize("case", list(CASES))
def test_every_family_quantizes_int8_in_place(case, tmp_path):
    """int8 per channel on every architecture: each weight lands where its float weight was (within half a
    step of it), and the model generates as its dequantized twin does."""
    path = str(tmp_path / case)
    build_checkpoint(path, case)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, quantization="int8")
    twin = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    params = dict(model_of(twin).named_parameters(remove_duplicate=False))  # a tied head by its own name
    weights = quantized_weights(model_of(llm))
    assert weights and any(name.endswith("embed_tokens.weight") for name in weights)  # 8-bit tables too
    for name, w in weights.items():
        ref = params[name].detach()
        step = ref.abs().amax(dim=-1, keepdim=True) / 127
        assert ((w.dequantize() - ref).abs() <= step * 0.5 + 1e-7).all(), name
    assert_same_greedy(generate(llm, PROMPTS[:2]), generate(dequantized_twin(llm, path), PROMPTS[:2]))


def test_bf16_model_prefix_caching_n_and_preemption(llama128):
    """A bfloat16 model (bf16 embeddings, quantized projections, the bf16 GEMM for prefill) through prefix
    caching, n > 1 siblings and preemption with chunked prefill: the same greedy tokens every way."""
    kwargs = dict(skip_tokenizer_init=True, dtype="bfloat16", quantization="int4")
    llm = LLM(llama128, num_kv_blocks=64, **kwargs)
    methods = [m.method for m in model_of(llm).modules() if getattr(m, "method", None) is not None]
    assert all(m.bf16_gemm for m in methods if m.quantized) and any(m.quantized for m in methods)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (37, 20, 45)]
    ref = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]  # fmt: skip
    again = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == ref[0]
    forked = llm.generate({"prompt_token_ids": prompts[2]}, SamplingParams(n=3, temperature=0, max_tokens=16,
                          ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    assert [c.token_ids for c in forked.outputs] == [ref[2]] * 3
    assert_pool_whole(llm)
    small = LLM(llama128, num_kv_blocks=5, max_num_batched_tokens=16, **kwargs)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_pool_whole(small)


# ---------------------------------------------------------------------------------------------------------
# GGUF files kept quantized
# ---------------------------------------------------------------------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rows of each head interleaved for its rope layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_quantized_llama_gguf(path: str, hf_path: str, types: dict[str, gguf.GGMLQuantizationType]) -> None:
    """The tiny Llama checkpoint as a GGUF file with quantized matrices (gguf-py's quantizers)."""
    from safetensors.torch import load_file

    with open(os.path.join(hf_path, "config.json")) as f:
        cfg = json.load(f)
    sd = load_file(os.path.join(hf_path, "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    F32 = gguf.GGMLQuantizationType.F32
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("block_count", cfg["num_hidden_layers"]),
                       ("feed_forward_length", cfg["intermediate_size"]), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("vocab_size", cfg["vocab_size"]),
                       ("rope.dimension_count", cfg["hidden_size"] // heads)]:
        writer.add_uint32(f"llama.{key}", value)  # fmt: skip
    writer.add_float32("llama.rope.freq_base", float(cfg.get("rope_theta", 10000.0)))
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for name, tensor in sd.items():
        t = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, part = "token_embd.weight", "token_embd"
        elif name == "model.norm.weight":
            gname, part = "output_norm.weight", "norm"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            part = names[module]
            gname = f"blk.{layer}.{part}.weight"
            if part == "attn_q":
                t = _permute(t, heads)
            elif part == "attn_k":
                t = _permute(t, kv_heads)
        qtype = types.get(part, F32) if t.ndim == 2 else F32
        data = t if qtype == F32 else gguf.quants.quantize(t, qtype)
        writer.add_tensor(gname, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_kept_quantized_equals_the_dequantized_path(llama128, tmp_path):
    """Q4_0 q / Q8_0 k (fused QKV promoted to 8-bit codes), Q5_1 v, Q4_1 MLP, Q5_0 down, Q8_0 table: the
    llama q/k rows un-permuted in the quantized rows, the tied head the embedding's own weight."""
    Q = gguf.GGMLQuantizationType
    path = str(tmp_path / "llama.gguf")
    types = {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q5_1, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1,
             "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0, "token_embd": Q.Q8_0}  # fmt: skip
    write_quantized_llama_gguf(path, llama128, types)
    kept = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    model = model_of(kept)
    weights = quantized_weights(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.lm_head.weight, QuantizedWeight)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert (qkv.bits, qkv.group, qkv.scales.dtype) == (8, 32, torch.float16)
    assert model.model.layers[0].mlp.gate_up_proj.weight.bits == 4
    assert len({id(w) for w in weights.values()}) == 1 + 4 * 2  # the table (the head's too), 4 per layer
    widened = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, quantization="none")
    assert not quantized_weights(model_of(widened))
    for name, p in model_of(widened).named_parameters():
        if name in weights:
            torch.testing.assert_close(weights[name].dequantize(), p.detach(), rtol=0, atol=0)
    assert_same_greedy(generate(kept), generate(widened))


def test_q4_0_gguf_streams_no_mins_and_equals_the_dequantized_path(llama128, tmp_path):
    """A Q4_0 file (Q8_0 table) keeps every projection as centred 4-bit codes (no stored mins: 4.5 bits per
    weight, as the file), fused QKV and gate|up included, and decodes greedily as its dequantized weights."""
    Q = gguf.GGMLQuantizationType
    path = str(tmp_path / "q4_0.gguf")
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_quantized_llama_gguf(path, llama128, {**{p: Q.Q4_0 for p in parts}, "token_embd": Q.Q8_0})
    kept = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    model = model_of(kept)
    layer = model.model.layers[0]
    for w in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight):
        assert (w.bits, w.centred, w.scales.dtype) == (4, True, torch.float16)
        assert w.nbytes == w.out_features * w.in_features * 18 // 32
    widened = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, quantization="none")
    assert_same_greedy(generate(kept), generate(widened))


def test_a_float_gguf_quantizes_at_load_as_its_hf_checkpoint_does(llama128, tmp_path):
    """`quantization=` on an F32 / F16 / BF16 GGUF file quantizes it at load like any float checkpoint
    (a file with quantized tensors refuses: they would be quantized twice)."""
    path = str(tmp_path / "float.gguf")
    write_quantized_llama_gguf(path, llama128, {})
    for method in ("int8", "int4"):
        kwargs = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, quantization=method)
        from_gguf, from_hf = LLM(path, **kwargs), LLM(llama128, **kwargs)
        a, b = quantized_weights(model_of(from_gguf)), quantized_weights(model_of(from_hf))
        assert a.keys() == b.keys() and a
        for name in a:
            torch.testing.assert_close(a[name].dequantize(), b[name].dequantize(), rtol=0, atol=0)
        assert_same_greedy(generate(from_gguf), generate(from_hf))


def test_default_model_keeps_its_quantized_tensors(default_model):
    kept = LLM(default_model, dtype="float32", kv_cache_gib=0.05)
    model = model_of(kept)
    weights = quantized_weights(model)
    table = model.model.embed_tokens.weight
    assert isinstance(table, QuantizedWeight) and model.lm_head.weight is table  # Q8_0, tied
    assert all(isinstance(m.weight, QuantizedWeight) for m in model.modules() if isinstance(m, Linear))
    assert sum(w.nbytes for w in {id(w): w for w in weights.values()}.values()) < 1.05 * os.path.getsize(
        default_model
    )
    widened = LLM(default_model, dtype="float32", kv_cache_gib=0.05, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    got = [o.outputs[0].text for o in kept.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].text for o in widened.generate(prompts, params, use_tqdm=False)]
    assert got == want


_RSS_SCRIPT = """
import gc, json, sys
import torch
from perfxlm.config import EngineConfig
from perfxlm.model.loader import load_model

def rss():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "RssAnon"))}

cfg = EngineConfig(quantization=sys.argv[1] or None, dtype="bfloat16").resolve()
gc.collect()
before = rss()
model = load_model(cfg)
after = rss()
print(json.dumps({k: after[k] - before[k] for k in before}))
"""


def test_default_model_resident_memory_is_near_its_file_size(default_model):
    """Loading the Q4_1 default model adds about its file size to the process (the file's pages are
    handed back after the copy); dequantized to bf16 it would add 2.5-3x that."""
    size = os.path.getsize(default_model)
    env = {**os.environ, "TQDM_DISABLE": "1", "PERFXLM_NATIVE": "0"}  # loading needs no kernels
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, ""], capture_output=True, text=True, env=env,
                         timeout=300, check=True)  # fmt: skip
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert grown["VmRSS"] < 1.25 * size, (grown, size)


_ENGINE_RSS_SCRIPT = """
import gc, json, sys
import torch, transformers, tokenizers, gguf
import perfxlm.engine, perfxlm.llm
from perfxlm import LLM

def rss():
    with open("/proc/self/status") as f:
        return [int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS")][0]

gc.collect()
before = rss()
llm = LLM(sys.argv[1], num_kv_blocks=16)
gc.collect()
caches = [m.kv_cache for m in llm.llm_engine.core.model.modules() if getattr(m, "kv_cache", None) is not None]
kv = sum(t.nbytes for c in caches for t in (c.key, c.value, c.key_scale, c.value_scale) if t is not None)
print(json.dumps({"grown": rss() - before, "kv": kv}))
"""


def test_whole_engine_resident_memory_after_load_is_within_1_6x_the_file(default_model):
    """The issue's measure: the process's resident growth after `LLM(file)` (imports done before), less
    the KV cache, at most 1.6x the file: weights held as they are in the file, plus the tokenizer, the
    kernels and what loading leaves behind (the allocator's freed pages are handed back)."""
    size = os.path.getsize(default_model)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-c", _ENGINE_RSS_SCRIPT, default_model], capture_output=True,
                         text=True, env=env, timeout=600, check=True)  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["grown"] - got["kv"] <= 1.6 * size, (got, size)


# ---------------------------------------------------------------------------------------------------------
# Errors before any weight is read
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr("perfxlm.model.loader.hf.iter_safetensors_weights", refuse)
    monkeypatch.setattr("perfxlm.model.loader.gguf.iter_gguf_weights", refuse)


def test_errors_come_before_weights_are_read(llama128, mixtral, default_model, no_weight_reads):
    with pytest.raises(ValueError, match=r"quantization='int2' is not supported; supported: int8, int4, nf4"):
        LLM(llama128, skip_tokenizer_init=True, quantization="int2")
    with pytest.raises(ValueError, match=r"quantization_group_size=128 does not divide the input size 64 of "
                                         r"model.layers.0.self_attn.qkv_proj.weight"):  # fmt: skip
        LLM(mixtral, skip_tokenizer_init=True, quantization="int4", quantization_group_size=128)
    with pytest.raises(ValueError, match=r"\(the default for nf4\) does not divide the input size 96"):
        LLM(mixtral, skip_tokenizer_init=True, quantization="nf4")
    with pytest.raises(ValueError, match=r"quantized tensors \(Q4_1, Q8_0\).*'none' \(dequant"):
        LLM(default_model, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a .gguf file"):
        LLM(llama128, skip_tokenizer_init=True, quantization="gguf")


def test_dummy_weights_quantize_and_the_cli_flags_reach_the_engine(llama128):
    import argparse

    from perfxlm.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([llama128, "-q", "int4", "--quantization-group-size", "64",
                              "--no-quantization-symmetric", "--load-format", "dummy"])  # fmt: skip
    kwargs = engine_kwargs(args)
    assert (kwargs["quantization"], kwargs["quantization_group_size"], kwargs["quantization_symmetric"]) == (
        "int4", 64, False,
    )  # fmt: skip
    llm = LLM(kwargs.pop("model"), skip_tokenizer_init=True, **{**kwargs, "num_kv_blocks": 16})
    weights = quantized_weights(model_of(llm))
    # int4's mixed precision (on by default) gives 5-bit codes where Q4_K_M would not have Q4_K (input
    # sizes not multiples of 256, down in llama.cpp's layers), all in the given group, and Q8_0's form
    # (group 32) to the QKV holding a V that Q4_K_M widens to Q8_0; the head 6-bit (Q6_K's codes)
    layers = {n: w for n, w in weights.items() if "layers" in n}
    wide = {n for n in layers if "qkv" in n and use_more_bits(layer_of(n), model_of(llm).config.num_hidden_layers)}
    assert wide and all((w.bits, w.group, w.centred) == (8, 32, True) for n, w in layers.items() if n in wide)
    assert all(w.bits in (4, 5) and w.group == 64 for n, w in layers.items() if n not in wide)
    assert {w.bits for n, w in layers.items() if "qkv" in n and n not in wide} == {5}  # 128 inputs
    assert all(w.bits == 6 for n, w in weights.items() if "lm_head" in n)
    assert len(generate(llm, PROMPTS[:1])[0][0]) == GREEDY.max_tokens
