"""Pre-quantized checkpoints kept packed: AWQ (GEMM), GPTQ (4 / 8 bits, symmetric or not, act-order,
v1 / v2 zero points) and compressed-tensors (pack-quantized W4A16, int-quantized W8A8, float-quantized
FP8) loaded as QuantizedWeights without widening, greedy float32 output and logprobs equal to
transformers on the dequantized weights, every family; bad configs and packed shapes refused by name
before the model is built."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

from perfxlm.quant import joining
from perfxlm import LLM, SamplingParams
from perfxlm.config import EngineConfig
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.ops import native
from perfxlm.quant import QuantizedWeight
from tests.conftest import assert_pool_whole
from tests.model.test_architectures_vs_hf import CASES, build_checkpoint, hf_greedy_with_logprobs
from tests.quant.packed_checkpoints import (
    awq_parts, gptq_parts, input_key, set_quantization_config, write_compressed_tensors, write_packed,
)  # fmt: skip

NEW_TOKENS = 12
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [50, 60, 70], list(range(100, 141))]


@pytest.fixture(autouse=True)
def _exact_products(monkeypatch):
    """Float32 activations for weight-only formats (auto reads the environment) and one thread."""
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")
    # the checkpoints' float embedding and LM head kept float, as transformers reads them (quantizing
    # them at load: test_prequantized_head.py)
    monkeypatch.setenv("PERFXLM_PACKED_LM_HEAD", "float")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_llama(seed: int = 0):
    """Odd sizes: inputs of 96 and 160 (groups of 32 divide them, 64 and 128 do not), 6 heads on 2 KV."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.15,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def gptq_config(bits, group, sym=True, desc_act=False, fmt=None):
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act}
    if fmt is not None:
        config["checkpoint_format"] = fmt
    return config


def make_gptq(bits, group, sym=True, act_order=False, v2=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, int], torch.Tensor] = {}

    def parts(name, w):
        order = None
        if act_order:  # one permutation per input, shared by the projections reading it
            # keyed by width too: the maker outlives one model (PACKED is shared by tests of other shapes)
            order = orders.setdefault((input_key(name), w.shape[1]), torch.randperm(w.shape[1], generator=g))
        return gptq_parts(w, bits, group, sym, order, v2)

    fmt = "gptq_v2" if v2 else None
    return parts, gptq_config(bits, group, sym, act_order, fmt)


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
# name -> (parts maker, quantization_config, expected form of the q|k|v weight: bits, act-order, centred
# codes: a symmetric checkpoint keeps no mins)
PACKED = {
    "awq-g32": ((lambda name, w: awq_parts(w, 32)), AWQ_CONFIG, (4, False, False)),
    "awq-g32-sym": ((lambda name, w: awq_parts(w, 32, sym=True)), AWQ_CONFIG, (4, False, True)),
    "gptq-4bit-g32-asym": (*make_gptq(4, 32, sym=False), (4, False, False)),
    "gptq-4bit-g32-sym": (*make_gptq(4, 32), (4, False, True)),
    "gptq-4bit-g32-sym-act-order": (*make_gptq(4, 32, act_order=True), (4, True, True)),
    "gptq-8bit-g32-asym-act-order": (*make_gptq(8, 32, sym=False, act_order=True), (8, True, False)),
    "gptq-4bit-g16-as-8bit-codes": (*make_gptq(4, 16, sym=False), (8, False, False)),
    "gptq-4bit-g16-sym-as-8bit-codes": (*make_gptq(4, 16), (8, False, True)),
    "gptq-4bit-per-channel-v2": (*make_gptq(4, -1, sym=False, v2=True), (4, False, False)),
    "gptq-8bit-per-channel-sym": (*make_gptq(8, -1), (8, False, True)),
}
CT_SCHEMES = {
    # name -> (format, scheme kwargs, expected q|k|v form)
    "ct-w4a16-g32-sym": ("pack-quantized", dict(weights=dict(num_bits=4, type="int", symmetric=True,
                         strategy="group", group_size=32)), (4, "float")),  # fmt: skip
    "ct-w4a16-g32-asym": ("pack-quantized", dict(weights=dict(num_bits=4, type="int", symmetric=False,
                          strategy="group", group_size=32)), (4, "float")),  # fmt: skip
    "ct-w8a16-channel": ("pack-quantized", dict(weights=dict(num_bits=8, type="int", symmetric=True,
                         strategy="channel")), (8, "float")),  # fmt: skip
    "ct-w8a8-int8-per-token": ("int-quantized", dict(
        weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        input_activations=dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
    ), (8, "int8")),
    "ct-fp8-channel": ("float-quantized", dict(
        weights=dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
        input_activations=dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
    ), (8, "float")),
}


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, **kwargs)


def generate(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


def assert_matches(llm, hf, atol=2e-4, prompts=PROMPTS):
    tokens, logprobs = generate(llm, prompts)
    for prompt, got, got_lp in zip(prompts, tokens, logprobs):
        want, want_lp = hf_greedy_with_logprobs(hf, prompt, NEW_TOKENS)
        assert got == want, f"prompt of {len(prompt)} tokens"
        np.testing.assert_allclose(got_lp, want_lp, atol=atol, rtol=0)
    assert len({t for seq in tokens for t in seq}) > 4  # random enough that greedy output varies
    assert_pool_whole(llm)


def model_of(llm):
    return llm.llm_engine.core.model


def projections(model) -> dict[str, object]:
    return {name: m.weight for name, m in model.named_modules() if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}


@pytest.mark.parametrize("name", list(PACKED))
def test_awq_gptq_match_transformers_on_dequantized_weights(tmp_path, name):
    make_parts, qconfig, (bits, act_order, centred) = PACKED[name]
    hf = tiny_llama()
    path = str(tmp_path / name)
    write_packed(path, hf, make_parts, qconfig)
    llm = engine(path)
    weights = projections(model_of(llm))
    assert len(weights) == 8 and all(type(w) is QuantizedWeight for w in weights.values())  # kept packed
    qkv = weights["model.layers.0.self_attn.qkv_proj"]
    assert qkv.bits == bits and (qkv.input_order is not None) == act_order and qkv.levels is None
    assert (qkv.mins is None) == centred and all((w.mins is None) == centred for w in weights.values())
    assert_matches(llm, hf)
    if native.kernels() is not None:  # act-order too: the fused layer gathers each product's inputs
        assert fused_decode_of(llm).eligible and fused_decode_of(llm).steps > 0


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_match_transformers_on_dequantized_weights(tmp_path, name):
    fmt, scheme, (bits, act) = CT_SCHEMES[name]
    path = str(tmp_path / name)
    reference = write_compressed_tensors(path, tiny_llama(), scheme, fmt)
    hf = tiny_llama()
    hf.load_state_dict(reference)
    if act == "int8":  # the reference rounds activations as W8A8 per token does: absmax / 127, half to even
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and module is not hf.lm_head:
                module.register_forward_pre_hook(lambda _, args: (per_token_int8(args[0]),))
    llm = engine(path)
    qkv = projections(model_of(llm))["model.layers.0.self_attn.qkv_proj"]
    assert type(qkv) is QuantizedWeight and qkv.bits == bits and qkv.act == act
    assert (qkv.levels is not None) == (fmt == "float-quantized")
    # symmetric weight-only codes keep no mins (W8A8's products take stored ones)
    centred = scheme["weights"]["symmetric"] and act == "float" and fmt == "pack-quantized"
    assert (qkv.mins is None) == centred
    if act == "float":
        assert_matches(llm, hf)
    else:
        assert_matches_teacher_forced(llm, hf, atol=5e-2)


def assert_matches_teacher_forced(llm, hf, atol):
    """Activations rounded at run time: an activation within a float rounding of a half step rounds to
    the next int8 in one of two computations, and a random tiny model carries that to about 1e-2 in a
    logprob (as the native kernels against the engine's own torch rule, test_quant_engine). So each step
    is checked on the engine's own prefix: its token is transformers' greedy choice up to `atol`, and its
    logprob transformers' to `atol`."""
    tokens, logprobs = generate(llm)
    for prompt, got, got_lp in zip(PROMPTS, tokens, logprobs):
        with torch.no_grad():
            lp = hf(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1 :].log_softmax(-1)
        chosen = lp[torch.arange(len(got)), torch.tensor(got)]
        assert (chosen >= lp.max(-1).values - atol).all()
        np.testing.assert_allclose(got_lp, chosen.numpy(), atol=atol, rtol=0)
        want, _ = hf_greedy_with_logprobs(hf, prompt, 4)
        assert got[:4] == want  # the first steps, before any rounding flip matters
    assert_pool_whole(llm)


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127.0
    return torch.round(x / scale.clamp(min=1e-30)).clamp(-127, 127) * scale


FAMILIES = [c for c in CASES if not c.startswith("phi3")] + ["phi3-longrope-partial-sliding"]


@pytest.mark.parametrize("case", FAMILIES)
def test_every_family_gptq_act_order(tmp_path, case):
    """GPTQ 4-bit act-order in every family: fused q|k|v and gate|up (one order per input), Phi-3's
    checkpoint-fused projections, OPT's fc1 / fc2, MoE experts each with their own order."""
    path = str(tmp_path / case)
    hf = build_checkpoint(path, case)
    os.remove(os.path.join(path, "model.safetensors"))
    ks = [m.in_features for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)]
    ks += [p.shape[-1] for n, p in hf.named_parameters() if "experts" in n and p.dim() == 3]
    group = 32 if all(k % 32 == 0 for k in ks) else 16
    make_parts, qconfig = make_gptq(4, group, sym=False, act_order=True)
    write_packed(path, hf, make_parts, qconfig)
    llm = engine(path, max_num_batched_tokens=48)
    model = model_of(llm)
    kept = [v for m in model.modules() for v in vars(m).values() if type(v) is QuantizedWeight]
    assert kept and all(w.input_order is not None for w in kept)
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in model.parameters())  # experts packed
    assert_matches(llm, hf)


def test_int4_awq_and_gptq_take_the_int4_kernel_path(tmp_path):
    """Without act-order an AWQ / GPTQ 4-bit weight is the engine's own int4 form (4-bit codes, a scale and
    a min per group, or a scale alone where symmetric: Q4_0's form; no table, no input order): the same
    native products and the fused decode layer."""
    write_float(str(tmp_path / "float"))
    own = engine(str(tmp_path / "float"), quantization={"method": "int4", "calibration": False, "mixed_precision": False})
    for name in ("awq-g32", "gptq-4bit-g32-asym", "gptq-4bit-g32-sym"):
        make_parts, qconfig, _ = PACKED[name]
        path = str(tmp_path / name)
        write_packed(path, tiny_llama(), make_parts, qconfig)
        llm = engine(path)
        generate(llm)
        for w_own, w in zip(projections(model_of(own)).values(), projections(model_of(llm)).values()):
            assert (w.bits, w.levels, w.input_order, w.act) == (4, None, None, "float")
            assert (w_own.bits, w_own.levels, w_own.act) == (4, None, "float")
        fused = fused_decode_of(llm)
        assert fused.eligible and (fused.args is not None) == (native.kernels() is not None)  # it ran


def fused_decode_of(llm) -> FusedDecode:
    found = [m.fused_decode for m in model_of(llm).modules() if isinstance(getattr(m, "fused_decode", None), FusedDecode)]
    assert len(found) == 1
    return found[0]


def write_float(path: str) -> None:
    tiny_llama().save_pretrained(path)


def test_stacked_experts_keep_their_own_orders():
    k = 64
    orders = [torch.randperm(k) for _ in range(3)]
    experts = [QuantizedWeight(torch.randint(0, 256, (8, k), dtype=torch.uint8), torch.rand(8, 2), torch.rand(8, 2),
                               None, 8, 32, "float", 8, k, input_order=o) for o in orders]  # fmt: skip
    stack = joining.stack_experts(experts)
    for e, o in enumerate(orders):
        assert torch.equal(stack[e].input_order, o) and torch.equal(stack[e].dense(), experts[e].dense())
    with pytest.raises(ValueError, match="input order"):
        joining.cat_rows(experts[:2])


# ---- bad input: refused by name before the model is built ---------------------------------------------


@pytest.fixture(scope="module")
def awq_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("awq"))
    write_packed(path, tiny_llama(), PACKED["awq-g32"][0], AWQ_CONFIG)
    return path


def resolve(path: str, **kwargs):
    return EngineConfig(model=path, **kwargs).resolve()


@pytest.mark.parametrize(
    "change, match",
    [
        ({"quant_method": "squeezellm"}, "quant_method='squeezellm' is not supported"),
        ({"bits": 3}, "bits=3 for awq is not supported"),
        ({"version": "gemv"}, "version='gemv' for awq"),
        ({"zero_point": False}, "zero_point=False"),
        ({"group_size": 64}, "'model.layers.0.mlp.down_proj.qweight' holds 160 inputs, which group_size=64"),
        ({"group_size": 16}, "'model.layers.0.mlp.down_proj.scales' is F16 \\[5, 96\\].*needs F16/BF16/F32 \\[10, 96\\]"),
    ],
)
def test_bad_awq_config_names_the_field_before_the_model_is_built(awq_path, tmp_path, change, match):
    path = str(tmp_path / "bad")
    os.makedirs(path)
    for f in os.listdir(awq_path):
        os.symlink(os.path.join(awq_path, f), os.path.join(path, f)) if f != "config.json" else None
    with open(os.path.join(awq_path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    set_quantization_config(path, {**AWQ_CONFIG, **change})
    with pytest.raises(ValueError, match=match):
        resolve(path)


def test_gptq_bits_and_packed_shapes_disagreeing_with_config(tmp_path):
    make_parts, qconfig = make_gptq(4, 32, sym=False)
    path = str(tmp_path / "gptq")
    write_packed(path, tiny_llama(), make_parts, qconfig)
    set_quantization_config(path, {**qconfig, "bits": 2})
    with pytest.raises(ValueError, match="bits=2 for gptq is not supported; supported: 4, 8"):
        resolve(path)
    set_quantization_config(path, {**qconfig, "bits": 8})  # the codes are 4-bit: 8 bits halves K
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.qweight' holds 80 inputs at 8 bits, which group_size=32"):
        resolve(path)
    set_quantization_config(path, {**qconfig, "checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="checkpoint_format='marlin'"):
        resolve(path)


def test_act_order_that_differs_inside_a_fused_weight_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    path = str(tmp_path / "gptq")
    write_packed(path, tiny_llama(), lambda n, w: gptq_parts(w, 4, 32, True, torch.randperm(w.shape[1], generator=g)),
                 gptq_config(4, 32, desc_act=True))  # fmt: skip
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_up_proj.weight \\(gate, up\\): parts differ in input order"):
        engine(path)


def test_quantization_option_against_a_packed_checkpoint(awq_path, tmp_path):
    with pytest.raises(ValueError, match="pre-quantized awq checkpoint.*quantization=None or 'awq'"):
        resolve(awq_path, quantization="int4")
    with pytest.raises(ValueError, match="pre-quantized awq checkpoint"):
        resolve(awq_path, quantization="gptq")
    assert resolve(awq_path, quantization="awq_marlin").quant_config.method == "awq"  # vLLM's spelling
    float_path = str(tmp_path / "float")
    write_float(float_path)
    with pytest.raises(ValueError, match="quantization='gptq' names a pre-quantized checkpoint format"):
        resolve(float_path, quantization="gptq")


def test_compressed_tensors_static_activations_and_formats_refused(tmp_path):
    path = str(tmp_path / "ct")
    write_compressed_tensors(path, tiny_llama(), CT_SCHEMES["ct-w4a16-g32-sym"][1], "pack-quantized")
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    group = qc["config_groups"]["group_0"]
    bad = {**qc, "config_groups": {"group_0": {**group, "format": "naive-quantized"}}}
    set_quantization_config(path, bad)
    with pytest.raises(ValueError, match="config_groups.group_0.format='naive-quantized'"):
        resolve(path)
    static = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    bad = {**qc, "config_groups": {"group_0": {**group, "input_activations": static}}}
    set_quantization_config(path, bad)
    with pytest.raises(ValueError, match="static activation scales"):
        resolve(path)
    bad = {**qc, "config_groups": {"group_0": {**group, "weights": {**group["weights"], "num_bits": 2}}}}
    set_quantization_config(path, bad)
    with pytest.raises(ValueError, match="group_0.weights: num_bits=2 type='int' with pack-quantized"):
        resolve(path)
    set_quantization_config(path, {**qc, "quantization_status": "frozen"})
    with pytest.raises(ValueError, match="quantization_status='frozen'"):
        resolve(path)
    set_quantization_config(path, {**qc, "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    with pytest.raises(ValueError, match="quantization_config.kv_cache_scheme is not supported"):
        resolve(path)
    bad = {**qc, "config_groups": {"group_0": {**group, "weights": {**group["weights"], "group_size": 64}}}}
    set_quantization_config(path, bad)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj' has 160 inputs, which the scheme's group_size=64"):
        resolve(path)


def test_compressed_tensors_act_order_group_index():
    """pack-quantized with `actorder` (its GPTQ modifier's weight_g_idx): the same input order as GPTQ's."""
    from perfxlm.quant.formats import format_for
    from tests.quant.packed_checkpoints import pack_int32, quantize_groups

    n, k, group = 16, 96, 32
    order = torch.randperm(k, generator=torch.Generator().manual_seed(3))
    w = torch.randn(n, k)
    q, scales, zeros, dq = quantize_groups(w, 4, group, sym=True, order=order)
    g_idx = torch.empty(k, dtype=torch.int64).scatter_(0, order, torch.arange(k) // group)
    fmt = format_for({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": group, "actorder": "group"}}}})  # fmt: skip
    tensors = {"weight_packed": pack_int32(q, 4), "weight_scale": scales.float(), "weight_shape": torch.tensor([n, k]),
               "weight_g_idx": g_idx.to(torch.int32)}  # fmt: skip
    infos = {p: (tuple(t.shape), {torch.int32: "I32", torch.float32: "F32", torch.int64: "I64"}[t.dtype])
             for p, t in tensors.items()}  # fmt: skip
    fmt.check("m", infos)
    weight = fmt.build("m", tensors)
    assert weight.bits == 4 and torch.equal(weight.input_order, torch.argsort(g_idx, stable=True))
    torch.testing.assert_close(weight.dense(), dq, rtol=0, atol=1e-6)
    x = torch.randn(3, k)
    from perfxlm.ops.linear import linear

    torch.testing.assert_close(linear(x, weight), x @ dq.t(), rtol=1e-5, atol=1e-5)
