"""Every supported architecture against transformers: random-weight checkpoints built from transformers'
own config and model classes, greedy float32 output token-identical for 32 new tokens (and the chosen
tokens' logprobs equal), in one batch of mixed-length prompts; GGUF qwen2/qwen3 files with k-quants; the
vLLM quick-start program on an OPT-125m-shaped checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from perfxlm import LLM, SamplingParams
from tests.conftest import assert_pool_whole, default_model_or_skip
from tests.unit.test_gguf_dequant import random_k_blocks

NEW_TOKENS = 32
PROMPT_LENS = (1, 9, 30, 75)  # longer than every sliding window below, so the windows matter

COMMON = dict(
    vocab_size=1000, max_position_embeddings=512, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    # tiny matrices gain nothing from a second thread, and its barriers cost much on a busy machine
    if "quickstart" in request.node.name:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# name -> (config class, model class, config overrides); small sizes, GQA throughout
# fmt: off
CASES = {
    "qwen2-bias-tied-sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=12, max_window_layers=1,
    )),
    "qwen3-qknorm-headdim-bias": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, attention_bias=True, tie_word_embeddings=False,
    )),
    "mistral-sliding-mqa": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, sliding_window=10,
    )),
    "opt-pre-ln": ("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64,
        do_layer_norm_before=True,
    )),
    "opt-post-ln-projected": ("OPTConfig", "OPTForCausalLM", dict(  # opt-350m's shape
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
        do_layer_norm_before=False,
    )),
    "gemma2-softcap-local-global": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=12,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, initializer_range=0.02,
    )),
    "phi3-longrope-partial-sliding": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=14,
        max_position_embeddings=1024, original_max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [2.0, 3.0, 4.0, 5.0],
        },
    )),
    "qwen2moe-shared-dense-layer": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1],
    )),
    "mixtral-sliding": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=12,
    )),
}
# fmt: on


def build_checkpoint(path: str, case: str, seed: int = 0):
    """Save a random-weight transformers model for `case`; returns the model (float32, eval)."""
    config_cls, model_cls, overrides = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms and biases start at constants: perturb them so they count
                param.add_(torch.randn_like(param) * 0.1)
            if case.startswith("gemma2") and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)  # attention scores large enough that the soft cap bends them
    model.save_pretrained(path)
    return model


def hf_greedy_with_logprobs(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [step.float().log_softmax(-1)[0, t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def _prompts(seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(tmp_path, case):
    path = str(tmp_path / case)
    hf = build_checkpoint(path, case)
    assert_greedy_matches(path, hf)


def assert_generate_matches_hf(llm, hf, prompts, atol: float = 5e-4) -> list[list[int]]:
    """The engine's greedy tokens equal transformers' and its logprobs are within `atol`; returns the tokens."""
    tokens, logprobs = _generate(llm, prompts)
    for prompt, got, got_lp in zip(prompts, tokens, logprobs):
        want, want_lp = hf_greedy_with_logprobs(hf, prompt, len(got))
        assert got == want, f"prompt of {len(prompt)} tokens"
        np.testing.assert_allclose(got_lp, want_lp, atol=atol, rtol=0)
    return tokens


def assert_greedy_matches(path: str, hf) -> None:
    """The engine (prefix caching, chunked prefill) against transformers' greedy output and logprobs."""
    # a small token budget chunks the longer prompts, so prefill also runs over cached context
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=48)
    prompts = _prompts()
    tokens = assert_generate_matches_hf(llm, hf, prompts, atol=2e-4)
    assert len(set(tokens[-1])) > 4  # the weights are random enough that greedy output varies
    # again: now the prompts' full blocks come from the prefix cache
    assert _generate(llm, prompts)[0] == tokens
    assert_pool_whole(llm)


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_logits_close_to_float32(tmp_path, case):
    path = str(tmp_path / case)
    build_checkpoint(path, case)
    assert_bfloat16_logits_close(path, routed="moe" in case or "mixtral" in case)


def assert_bfloat16_logits_close(path: str, routed: bool) -> None:
    """`routed`: a mixture of experts, where a near-tie in the router may flip an expert in bfloat16."""
    from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
    from perfxlm.model.loader import get_model, load_hf_config
    from perfxlm.worker.model_runner import ModelRunner

    config = load_hf_config(path)
    ids = torch.tensor(_prompts()[-1][:40])
    logits = {}
    # (compute dtype, weight dtype, KV cache dtype): float32, bf16 throughout, and bf16 weights and KV
    # cache under float32 compute (what bfloat16 means on CPUs without bf16 arithmetic)
    modes = {
        "float32": (torch.float32, None, torch.float32),
        "bfloat16": (torch.bfloat16, None, torch.bfloat16),
        "bf16 weights": (torch.float32, torch.bfloat16, torch.bfloat16),
    }
    for name, (dtype, weight_dtype, kv_dtype) in modes.items():
        model = get_model(path, config, dtype, "safetensors", weight_dtype=weight_dtype)
        ModelRunner(model, num_blocks=4, block_size=16, dtype=kv_dtype)
        meta = AttentionMetadata(
            torch.arange(40), 0, None, None, None, [PrefillSeq(0, 40, 0, torch.arange(3))]
        )
        with torch.inference_mode(), set_forward_context(meta):
            logits[name] = model.compute_logits(model(ids, torch.arange(40)))
    ref = logits["float32"]
    for name in ("bfloat16", "bf16 weights"):
        got = logits[name]
        # the same tolerance as the Llama test: 0.1 absolute + 5 % of the float32 logit range, on every
        # row; with experts, a near-tie in the router may pick another expert in bfloat16 for a few tokens
        row_err = (got - ref).abs().amax(dim=-1)
        off = (row_err > 0.1 + 0.05 * (ref.max() - ref.min()).item()).float().mean().item()
        assert off <= (0.1 if routed else 0.0), (name, row_err)
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8, name


def test_per_expert_and_fused_expert_checkpoints_load_alike(tmp_path):
    """transformers 5 keeps experts stacked in memory ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) while
    hub checkpoints store one tensor per expert: both load into the same parameters."""
    from safetensors.torch import load_file, save_file

    from perfxlm.model.loader import get_model, load_hf_config

    path = str(tmp_path / "moe")
    build_checkpoint(path, "qwen2moe-shared-dense-layer")
    config = load_hf_config(path)
    per_expert = get_model(path, config, torch.float32, "safetensors")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}

    def take(prefix: str, part: str) -> list[torch.Tensor]:
        return [tensors.pop(f"{prefix}.{e}.{part}.weight") for e in range(6)]

    for layer in (0, 2):  # the sparse layers (layer 1 is dense)
        prefix = f"model.layers.{layer}.mlp.experts"
        gate, up, down = take(prefix, "gate_proj"), take(prefix, "up_proj"), take(prefix, "down_proj")
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        fused[f"{prefix}.down_proj"] = torch.stack(down)
    save_file({**tensors, **fused}, os.path.join(path, "model.safetensors"))
    stacked = get_model(path, config, torch.float32, "safetensors")
    for (name, a), (_, b) in zip(per_expert.state_dict().items(), stacked.state_dict().items()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------------
# GGUF: qwen2 / qwen3 files with k-quant and Q5 tensors against transformers on the same (dequantized) weights
# ---------------------------------------------------------------------------------------------------------

# GGUF tensor -> (quantization, HF name); k-quant super-blocks need rows of 256
GGUF_TENSORS = {
    "attn_q": (gguf.GGMLQuantizationType.Q4_K, "self_attn.q_proj"),
    "attn_k": (gguf.GGMLQuantizationType.Q5_K, "self_attn.k_proj"),
    "attn_v": (gguf.GGMLQuantizationType.Q6_K, "self_attn.v_proj"),
    "attn_output": (gguf.GGMLQuantizationType.Q5_0, "self_attn.o_proj"),
    "ffn_gate": (gguf.GGMLQuantizationType.Q5_1, "mlp.gate_proj"),
    "ffn_up": (gguf.GGMLQuantizationType.Q4_K, "mlp.up_proj"),
    "ffn_down": (gguf.GGMLQuantizationType.Q6_K, "mlp.down_proj"),
}
# llama.cpp's Q4_K_M allocation at widths of 256 multiples: Q4_K, with Q6_K for V, down and the tied
# embedding / head (kept with two-level scales: a byte per group, float16 per 256)
Q4_K_M_TENSORS = {part: (gguf.GGMLQuantizationType.Q6_K if part in ("attn_v", "ffn_down")
                         else gguf.GGMLQuantizationType.Q4_K, hf) for part, (_, hf) in GGUF_TENSORS.items()}  # fmt: skip
# fp16 super-scale per k-quant type giving weights of standard deviation about 0.12
K_SCALE = {gguf.GGMLQuantizationType.Q4_K: 4e-4, gguf.GGMLQuantizationType.Q5_K: 2e-4,
           gguf.GGMLQuantizationType.Q6_K: 1e-4}  # fmt: skip


def _quantized(rng, qtype, shape, std=0.12) -> np.ndarray:
    if qtype in K_SCALE:
        return random_k_blocks(rng, qtype, shape, d=K_SCALE[qtype])
    return gguf.quants.quantize((rng.standard_normal(shape) * std).astype(np.float32), qtype)


def write_gguf_decoder(path: str, arch: str, seed: int = 0, q4_k_m: bool = False) -> dict[str, torch.Tensor]:
    """A small qwen2/qwen3 GGUF file (mixed types, or Q4_K_M's); returns its weights dequantized by gguf-py,
    under HF names."""
    Q = gguf.GGMLQuantizationType
    hidden, inter, layers, heads, kv_heads, head_dim, vocab = 256, 512, 2, 4, 2, 64, 1000
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch)
    for key, value in [("block_count", layers), ("context_length", 512), ("embedding_length", hidden),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads)]:  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 1000000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if arch == "qwen3":
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)

    hf: dict[str, torch.Tensor] = {}

    def add(name: str, hf_name: str, data: np.ndarray, qtype) -> None:
        writer.add_tensor(name, data, raw_dtype=qtype)
        with np.errstate(invalid="ignore", over="ignore"):
            values = gguf.quants.dequantize(data, qtype) if qtype not in (Q.F32,) else data
        hf[hf_name] = torch.from_numpy(np.array(values, dtype=np.float32))

    def vector(n: int, center: float) -> np.ndarray:
        return (center + 0.1 * rng.standard_normal(n)).astype(np.float32)

    emb_type = Q.Q6_K if q4_k_m else Q.Q8_0
    emb = random_k_blocks(rng, emb_type, (vocab, hidden), d=1.2e-4) if q4_k_m else _quantized(rng, Q.Q8_0, (vocab, hidden), 0.15)
    add("token_embd.weight", "model.embed_tokens.weight", emb, emb_type)
    add("output_norm.weight", "model.norm.weight", vector(hidden, 1.0), Q.F32)
    q, kv = heads * head_dim, kv_heads * head_dim
    sizes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
             "attn_output": (hidden, q), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
             "ffn_down": (hidden, inter)}  # fmt: skip
    for i in range(layers):
        blk, hf_blk = f"blk.{i}", f"model.layers.{i}"
        for part, (qtype, hf_part) in (Q4_K_M_TENSORS if q4_k_m else GGUF_TENSORS).items():
            weight = _quantized(rng, qtype, sizes[part])
            add(f"{blk}.{part}.weight", f"{hf_blk}.{hf_part}.weight", weight, qtype)
        if arch == "qwen2":  # q/k/v biases
            for p, n in (("q", q), ("k", kv), ("v", kv)):
                add(f"{blk}.attn_{p}.bias", f"{hf_blk}.self_attn.{p}_proj.bias", vector(n, 0.0), Q.F32)
        else:  # q/k head norms
            for p in ("q", "k"):
                norm = vector(head_dim, 1.0)
                add(f"{blk}.attn_{p}_norm.weight", f"{hf_blk}.self_attn.{p}_norm.weight", norm, Q.F32)
        add(f"{blk}.attn_norm.weight", f"{hf_blk}.input_layernorm.weight", vector(hidden, 1.0), Q.F32)
        add(f"{blk}.ffn_norm.weight", f"{hf_blk}.post_attention_layernorm.weight", vector(hidden, 1.0), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture
def exact_quantized_products(monkeypatch):
    """Quantized weights multiplied in float32 (no int8 activation blocks): equal to the float model."""
    monkeypatch.setenv("PERFXLM_QUANT_ACTIVATIONS", "float32")


@pytest.mark.parametrize("arch,q4_k_m", [("qwen2", False), ("qwen3", False), ("qwen2", True)])
def test_gguf_k_quants_match_transformers(tmp_path, arch, q4_k_m, exact_quantized_products):
    path = str(tmp_path / f"{arch}.gguf")
    weights = write_gguf_decoder(path, arch, q4_k_m=q4_k_m)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    hf_config = getattr(transformers, "Qwen2Config" if arch == "qwen2" else "Qwen3Config")(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    model_cls = getattr(transformers, "Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM")
    hf = model_cls(hf_config).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    prompts = _prompts(seed=1)
    tokens, logprobs = _generate(llm, prompts)
    for prompt, got, got_lp in zip(prompts, tokens, logprobs):
        want, want_lp = hf_greedy_with_logprobs(hf, prompt, NEW_TOKENS)
        assert got == want, f"prompt of {len(prompt)} tokens"
        np.testing.assert_allclose(got_lp, want_lp, atol=2e-4, rtol=0)
    assert len(set(tokens[-1])) > 4
    if q4_k_m:  # the two-level weights are held as such and decode on the fused layer, not the module path
        from perfxlm.model.fused_decode import fused_decode_steps
        from perfxlm.quant import QuantizedWeight

        model = llm.llm_engine.core.model
        held = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)]
        assert sum(w.two_level for w in held) >= 3 * 2  # o, gate|up, down per layer (QKV mixes Q4_K with Q6_K)
        assert sum(w.bits == 6 and w.two_level for w in held) >= 2 + 1  # Q6_K's downs and the tied head: 6-bit codes
        assert fused_decode_steps(model) > 0


# ---------------------------------------------------------------------------------------------------------
# Clear failures for what is not supported
# ---------------------------------------------------------------------------------------------------------


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path):
    path = tmp_path / "weird"
    path.mkdir()
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4
    )
    config.architectures = ["FancyNewForCausalLM"]
    config.save_pretrained(path)
    with pytest.raises(
        ValueError, match=r"FancyNewForCausalLM.*Supported:.*Gemma2ForCausalLM.*OPTForCausalLM"
    ):
        LLM(str(path), skip_tokenizer_init=True, load_format="dummy")


def test_unsupported_gguf_tensor_type_fails_at_load(tmp_path):
    path = str(tmp_path / "q8_1.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    for key, value in [("block_count", 1), ("embedding_length", 32), ("attention.head_count", 2)]:
        writer.add_uint32(f"qwen2.{key}", value)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    writer.add_tensor(
        "token_embd.weight",
        np.zeros((8, 32 // block_elems * block_bytes), dtype=np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.Q8_1,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from perfxlm.model.loader.gguf import iter_gguf_weights

    with pytest.raises(ValueError, match=r"token_embd.weight.*Q8_1 is not supported \(supported: .*Q4_K"):
        iter_gguf_weights(path)


# ---------------------------------------------------------------------------------------------------------
# vLLM's quick start, unchanged but for the import and the model path
# ---------------------------------------------------------------------------------------------------------

QUICKSTART = """
from vllm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="facebook/opt-125m")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""

# facebook/opt-125m's config.json
OPT_125M = dict(
    vocab_size=50272,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    ffn_dim=3072,
    max_position_embeddings=2048,
    do_layer_norm_before=True,
    word_embed_proj_dim=768,
    activation_function="relu",
    enable_bias=True,
    layer_norm_elementwise_affine=True,
    bos_token_id=2,
    eos_token_id=2,
    pad_token_id=1,
    dropout=0.1,
    attention_dropout=0.0,
    init_std=0.02,
    _remove_final_layer_norm=False,
)


def test_vllm_quickstart_on_opt_125m_shaped_checkpoint(tmp_path):
    from perfxlm.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(default_model_or_skip())  # a GPT-2-style BPE; its ids all fit OPT's vocabulary
    assert len(tokenizer) <= OPT_125M["vocab_size"]
    path = str(tmp_path / "opt-125m")
    config = transformers.OPTConfig(**OPT_125M, architectures=["OPTForCausalLM"])
    with torch.device("meta"):  # random values filled below: 3x faster than transformers' initialisation
        model = transformers.OPTForCausalLM(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("layer_norm.weight") else 0.0, 0.02, generator=gen)
    model.tie_weights()
    model.half().save_pretrained(path)  # stored as the hub's checkpoint is, in float16
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["OPTForCausalLM"]

    program = QUICKSTART.replace("from vllm import", "from perfxlm import").replace("facebook/opt-125m", path)
    scope: dict = {}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(program, "quickstart.py", "exec"), scope)
    lines = stdout.getvalue().splitlines()
    assert [line.split(", Generated text")[0] for line in lines] == [
        f"Prompt: {p!r}" for p in scope["prompts"]
    ]
    for out in scope["outputs"]:
        assert 1 <= len(out.outputs[0].token_ids) <= 16  # vLLM's default max_tokens
        assert out.outputs[0].finish_reason in ("length", "stop")
    assert_pool_whole(scope["llm"])
