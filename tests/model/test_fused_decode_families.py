"""The fused decode layer on every family it covers, under every CPU plan, against the module path.

Each case runs greedy decoding twice on the same engine: once with the fused all-decode step, once with
it switched off (the module path, itself checked against transformers elsewhere). Weights float32 and
bf16 in both layouts (rows: what CPUs with bf16 arithmetic get; panels: what the others get), whatever
this machine's CPU is, so every path is tested on every machine.
"""

from __future__ import annotations

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.model.fused_decode import FusedDecode
from perfxlm.model.layers.embed_head import LMHead, VocabEmbedding
from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import native_int8_blocks
from perfxlm.quant import ActivationMode, QuantizedWeight
from tests.model import test_recent_families_vs_hf as recent
from tests.model.test_architectures_vs_hf import _prompts, build_checkpoint

# the MoE cases fuse their attention half (gpt-oss's with sinks, on sliding and full layers) and run the
# expert MLP as a module between calls; Qwen2-MoE mixes such layers with wholly fused dense ones
FUSED = ["qwen2-bias-tied-sliding", "qwen3-qknorm-headdim-bias", "mistral-sliding-mqa",
         "gemma2-softcap-local-global", "phi3-longrope-partial-sliding", "gemma3-softcaps-untied",
         "glm-partial-interleaved", "glm4-post-norms", "gptoss-sinks-alternating",
         "qwen2moe-shared-dense-layer"]  # fmt: skip
MODULE_ONLY = ["opt-pre-ln", "deepseekv2-lite-yarn"]
PLANS = {
    "float32": ("float32", {}),
    "bf16-rows-native": ("bfloat16", dict(layout="rows", gemm="bf16", native_max_rows=4, bf16_compute="float32")),
    "bf16-rows-gemm": ("bfloat16", dict(layout="rows", gemm="float32", native_max_rows=0, bf16_compute="float32")),
    "bf16-panels": ("bfloat16", dict(layout="panels", gemm="float32", native_max_rows=256, bf16_compute="float32")),
}


# The two paths sum some float32 values in another order (1e-5 apart in log-probability here with torch's
# bf16 GEMM). Where rows past native_max_rows round the activations to bf16, such a difference can move
# one activation across a bf16 rounding boundary (one bf16 ulp, 0.4 %), which the next layers carry:
# measured up to 2e-4 on the Gemma 3 case with the bf16 dot-product kernel. Tokens must still agree.
_LOGPROB_TOL = {"float32": 1e-4, "bf16-rows-native": 1e-3, "bf16-rows-gemm": 1e-4, "bf16-panels": 1e-4}


@pytest.fixture(autouse=True)
def _one_thread_and_plan_restored():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu_plan.reset()
    yield
    cpu_plan.reset()
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for case in FUSED + MODULE_ONLY:
        (recent.build_checkpoint if case in recent.CASES else build_checkpoint)(str(root / case), case)
        paths[case] = str(root / case)
    return paths


def _generate(llm, monkeypatch, fused: bool):
    calls = {"fused": 0}
    original = FusedDecode.run

    def counting(self, *args, **kwargs):
        calls["fused"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FusedDecode, "run", counting)
    if not fused:
        monkeypatch.setattr(FusedDecode, "applies", lambda self, x, meta: False)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    monkeypatch.undo()
    return outs, calls["fused"]


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("case", FUSED)
def test_fused_layer_matches_module_path(checkpoints, monkeypatch, case, plan):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    dtype, changes = PLANS[plan]
    if changes:
        cpu_plan.use(**changes)
    llm = LLM(checkpoints[case], skip_tokenizer_init=True, dtype=dtype, num_kv_blocks=64, enable_prefix_caching=False)
    fused, n_fused = _generate(llm, monkeypatch, fused=True)
    plain, n_plain = _generate(llm, monkeypatch, fused=False)
    assert n_fused >= 8 and n_plain == 0
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=_LOGPROB_TOL[plan])


@pytest.mark.parametrize("case", MODULE_ONLY)
def test_other_layers_take_the_module_path(checkpoints, case):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    llm = LLM(checkpoints[case], skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    fused = getattr(llm.llm_engine.core.model.model, "fused_decode", None)
    assert fused is None or fused.eligible is False


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("case", FUSED)
def test_fused_layer_matches_module_path_with_quantized_cache(checkpoints, monkeypatch, case, kv_cache_dtype):
    """The fused layer quantizes K/V with the same write and reads them with the same kernel as the
    module path: same tokens, logprobs to 1e-4."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    llm = LLM(checkpoints[case], skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    fused, n_fused = _generate(llm, monkeypatch, fused=True)
    plain, n_plain = _generate(llm, monkeypatch, fused=False)
    assert n_fused >= 8 and n_plain == 0
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in la:
                assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-4)


@pytest.mark.parametrize("case", MODULE_ONLY)
def test_other_layers_run_with_int8_cache(checkpoints, case):
    llm = LLM(checkpoints[case], skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, kv_cache_dtype="int8")
    ref = LLM(checkpoints[case], skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    outs, refs = (x.generate(prompts, params, use_tqdm=False) for x in (llm, ref))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    same = sum(a == b for o, r in zip(outs, refs) for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
    assert same >= 0.5 * sum(len(r.outputs[0].token_ids) for r in refs)


QUANT_PLANS = {  # (CPU plan changes, the engine's quant_activations)
    "int8-blocks": ({}, "int8"),
    "auto": ({}, "auto"),
    "float-acts": ({}, "float32"),
    "gemm-only": (dict(quant_max_rows=0), "float32"),
}


@pytest.mark.parametrize("plan", list(QUANT_PLANS))
@pytest.mark.parametrize("quantization", ["int8", "int4", "nf4", "w8a8", "w8a8-per-token"])
@pytest.mark.parametrize("case", ["qwen2-bias-tied-sliding", "gemma2-softcap-local-global"])
def test_fused_layer_matches_module_path_with_quantized_weights(checkpoints, monkeypatch, case, quantization, plan):
    """Quantized projections in the fused layer go through the same kernel, with the same activation
    mode, as the module path: same tokens, logprobs to 1e-4 (1e-2 where activations are rounded to
    int8), under each activation option (a build without int8 dots runs float32 activations on both
    paths, or declines where the module path rounds them in torch)."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    changes, activations = QUANT_PLANS[plan]
    cpu_plan.use(**changes)
    if quantization.startswith("w8a8") and activations == "float32":
        activations = "auto"  # w8a8 has no float32 activations (a ValueError, tested elsewhere)
    method = {"method": "w8a8", "activation_group_size": -1} if quantization == "w8a8-per-token" else quantization
    # a bfloat16 model: the one whose quantized products quantize activations under auto
    llm = LLM(checkpoints[case], skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=64,
              enable_prefix_caching=False, quantization=method, quant_activations=activations,
              quantization_group_size=32 if quantization in ("int4", "nf4") else None)  # fmt: skip
    fused, n_fused = _generate(llm, monkeypatch, fused=True)
    plain, n_plain = _generate(llm, monkeypatch, fused=False)
    modules = list(llm.llm_engine.core.model.modules())
    weights = [v for m in modules for v in vars(m).values() if isinstance(v, QuantizedWeight)]
    # the decoder layers' weights decide whether the fused layer runs (the 8-bit embedding table and
    # head are outside it)
    layer_weights = [v for m in modules if not isinstance(m, (VocabEmbedding, LMHead))
                     for v in vars(m).values() if isinstance(v, QuantizedWeight)]  # fmt: skip
    always_rounded = any(w.activations is ActivationMode.INT8 for w in layer_weights)
    if always_rounded and not all(native_int8_blocks(w) for w in layer_weights):
        # int8 activation blocks the fused kernel would not quantize (no int8 dots, NF4's levels, or
        # qwen2's 96-wide inputs): it declines and the module path rounds them
        assert n_fused == 0 and n_plain == 0
    else:
        assert n_fused >= 8 and n_plain == 0
    # Quantizing activations is a step function: a last-bit difference upstream (the fused layer's norm
    # and the module's round alike only to float summation order) can move one int8 value by one step.
    # (W8A8's per-token weights round their activations themselves: act "int8", whatever the mode says)
    rounded = any(w.activations is not ActivationMode.FLOAT or w.act == "int8" for w in weights)
    tol = 1e-2 if rounded else 1e-4
    for a, b in zip(fused, plain):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = next((i for i in range(len(ta)) if ta[i] != tb[i]), len(ta))
        if same < len(ta):  # only a near-tie may resolve the other way, and only where activations round
            at = a.outputs[0].logprobs[same]
            assert rounded and tb[same] in at, (ta, tb)
            assert at[ta[same]].logprob - at[tb[same]].logprob <= tol, (same, ta, tb)
        for la, lb in zip(a.outputs[0].logprobs[:same], b.outputs[0].logprobs[:same]):
            for tok in la:
                assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=tol)


def test_moe_attention_half_adds_attention_adapters(checkpoints, tmp_path, monkeypatch):
    """A MoE layer's fused attention half takes the step's LoRA adapters on q/k/v and o (the MLP's
    operands are empty: the kernel does not run it): the same tokens and logprobs as the module path."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    from perfxlm import LoRARequest
    from tests.lora.conftest import make_adapter

    base = checkpoints["gptoss-sinks-alternating"]
    adapter = make_adapter(base, str(tmp_path / "attn"), seed=5, r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    llm = LLM(base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False,
              enable_lora=True, max_lora_rank=8)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    loras = [LoRARequest("attn", 1, adapter), None, LoRARequest("attn", 1, adapter)]
    fused = llm.llm_engine.core.model.model.fused_decode
    calls, fused_run = [], fused.run
    monkeypatch.setattr(fused, "run", lambda *a: calls.append(1) or fused_run(*a))
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert calls and fused.eligible and fused.lora_fits
    fused.eligible = False
    want = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    plain = LLM(base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64).generate(
        prompts, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids != plain[0].outputs[0].token_ids  # the adapter changes the output
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in la:
                assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-4)


def _fused_decodes(llm) -> list[FusedDecode]:
    model = llm.llm_engine.core.model
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, FusedDecode)]


# where every layer is one decode_layer call with its MLP, a step's layers run as one DecodeStack call
# (csrc/decode_stack.cpp; Gemma's local and global rope tables too); layers with expert MLPs loop
STACK_CASES = {"qwen2-bias-tied-sliding": True, "qwen3-qknorm-headdim-bias": True, "mistral-sliding-mqa": True,
               "gemma2-softcap-local-global": True, "phi3-longrope-partial-sliding": True,
               "gemma3-softcaps-untied": True, "glm-partial-interleaved": True, "glm4-post-norms": True,
               "gptoss-sinks-alternating": False, "qwen2moe-shared-dense-layer": False}  # fmt: skip


@pytest.mark.parametrize("setup", ["float32", "bf16-rows-native", "int8-cache"])
@pytest.mark.parametrize("case", FUSED)
def test_decode_stack_gives_the_per_layer_calls_bits(checkpoints, case, setup):
    """One native call for the step's layers runs the same decode_layer per layer as the Python loop
    does: the same tokens and bit-identical logprobs, over a batch of prompts (several decode rows)."""
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    dtype, changes = PLANS.get(setup, ("float32", {}))
    if changes:
        cpu_plan.use(**changes)
    llm = LLM(checkpoints[case], skip_tokenizer_init=True, dtype=dtype, num_kv_blocks=64, enable_prefix_caching=False,
              kv_cache_dtype="int8" if setup == "int8-cache" else "auto")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    stacked = llm.generate(prompts, params, use_tqdm=False)
    decodes = _fused_decodes(llm)
    steps = sum(f.stack_steps for f in decodes)
    assert (steps >= 8) if STACK_CASES[case] else (steps == 0)
    for f in decodes:
        f.use_stack = False
    per_layer = llm.generate(prompts, params, use_tqdm=False)
    assert sum(f.stack_steps for f in decodes) == steps and sum(f.steps for f in decodes) >= 2 * 8
    for a, b in zip(stacked, per_layer):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: p.logprob for t, p in d.items()} for d in b.outputs[0].logprobs]  # fmt: skip


def test_decode_stack_is_rebuilt_for_new_caches_and_its_knob_is_checked(checkpoints, monkeypatch):
    if native.kernels() is None:
        pytest.skip("native kernels unavailable on this machine")
    llm = LLM(checkpoints["qwen2-bias-tied-sliding"], skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    (fused,) = _fused_decodes(llm)
    first = fused.stack
    assert first is not None and fused._stack() is first  # the same caches: the same stack
    fused.stack_caches = [object()] + fused.stack_caches[1:]  # as if a new runner had given the layers caches
    assert fused._stack() is not first and fused.stack_caches[0] is fused.stack_attention[0].kv_cache
    from perfxlm.model.fused_decode import decode_stack_enabled

    monkeypatch.setenv("PERFXLM_DECODE_STACK", "0")
    assert decode_stack_enabled() is False
    monkeypatch.setenv("PERFXLM_DECODE_STACK", "yes")
    with pytest.raises(ValueError, match="PERFXLM_DECODE_STACK='yes'"):
        decode_stack_enabled()
