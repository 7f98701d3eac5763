"""A `perfxlm`-flavor export under the default dtype `auto`: the folder records the engine's choices for the
model on this CPU (weight dtype and bf16 layout, KV cache, the quantized products' activation rounding,
the native build's tier) and stores its matrices as the engine holds them, so `LLM(folder)` under auto is
the module path under auto token for token (the default Q4_1 model; a random Llama held in bf16). Where
this CPU resolves otherwise (no native kernels, a lower instruction-set tier) or the run asks for
another dtype, the run takes those choices, as the module path would, and a warning says what moved."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter

import gguf
import numpy as np
import onnx
import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.config import EngineConfig
from perfxlm.export.engine_choices import EngineChoices
from perfxlm.export.package import export_onnx
from perfxlm.model.layers.embed_head import LMHead
from perfxlm.model.layers.linear import Linear
from perfxlm.ops import cpu_plan, isa, native
from tests.conftest import assert_pool_whole, default_model_or_skip, export_lower_tier, make_llama_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
# 1, 13 and 150 tokens; chunks of up to 144 rows: past the 4-bit GEMV row limit (128) without fast bf16,
# so prefill also takes the dequantizing GEMM, where a bf16 model's choice shows
PROMPTS = [[1], list(range(200, 213)), [(i * 37) % 30000 + 100 for i in range(150)]]
KW = dict(skip_tokenizer_init=True, num_kv_blocks=40, max_num_batched_tokens=144)
NOTES = "perfxlm.executor.graph"

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [lp[t].logprob for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    return tokens, logprobs, outs


def _bound(llm) -> Counter:
    """What each product runs: its linear method and the choices it made at load, whatever the layer."""
    from perfxlm.model.graph.kernels import Linear as GraphLinear

    executor = llm.llm_engine.core.executor
    if executor.model is None:
        methods = [k.layer.method for k in executor.graph.kernels if isinstance(k, GraphLinear)]
    else:
        methods = [m.method for m in executor.model.modules() if isinstance(m, (Linear, LMHead))]
    return Counter((m.name, *(getattr(m, a, None) for a in ("bf16_gemm", "int8_blocks", "round_in_torch")))
                   for m in methods)


def _assert_same(graph, module, prompts=PROMPTS) -> None:
    assert _bound(graph) == _bound(module)  # the module path's kernels, with the module path's choices
    cache = graph.llm_engine.core.executor.config.kv_cache_spec
    assert cache == module.llm_engine.core.executor.config.kv_cache_spec
    want, want_lp, _ = _generate(module, prompts)
    got, got_lp, _ = _generate(graph, prompts)
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-6, rtol=0)


def _notes(caplog) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.name == NOTES)


def _recorded(folder: str) -> dict:
    with open(os.path.join(folder, "perfxlm_onnx.json")) as f:
        return json.load(f)["engine"]


@pytest.fixture(scope="module")
def smollm_auto(tmp_path_factory) -> tuple[str, str]:
    model = default_model_or_skip()
    out = str(tmp_path_factory.mktemp("auto") / "graph")
    export_onnx(model, out, flavor="perfxlm")  # the default dtype: auto
    return model, out


def test_default_model_folder_is_the_module_path_under_auto(smollm_auto, caplog):
    model, out = smollm_auto
    recorded = _recorded(out)
    assert recorded == EngineChoices.of(EngineConfig(model=model).resolve()).to_json()
    assert recorded["dtype"] == "auto" and recorded["quantized_source"] == "gguf"
    if native.kernels() is not None:  # the engine's choice for a GGUF file: bf16 model, int8 activation blocks
        assert (recorded["weight_dtype"], recorded["kv_cache_dtype"]) == ("bfloat16", "bfloat16")
        assert recorded["quant_activations"] == "int8_native"
    with caplog.at_level(logging.WARNING, logger="perfxlm"):
        graph = LLM(out, **KW)
    assert _notes(caplog) == ""  # this CPU chose what the export recorded
    _assert_same(graph, LLM(model, **KW))
    fused = graph.llm_engine.core.executor.graph.fused_decode
    if native.kernels() is not None:  # all-decode steps on the module path's fused layer
        assert fused.args is not None and len(fused.args) == 30
    again, _, outs = _generate(graph)  # full blocks from the prefix cache now
    assert outs[2].num_cached_tokens >= 144
    assert_pool_whole(graph)


def test_a_cpu_that_resolves_otherwise_runs_its_own_choices_and_says_so(smollm_auto, caplog, monkeypatch):
    # without native kernels (and without fast bf16, which would make it a bfloat16 model computed by torch's
    # bf16 ops) the engine keeps a GGUF model float32 (weight-only products, float32 KV)
    model, out = smollm_auto
    monkeypatch.setattr("perfxlm.config._native_kernels_usable", lambda: False)
    monkeypatch.setattr("perfxlm.config.cpu_has_fast_bf16", lambda: False)
    with caplog.at_level(logging.WARNING, logger="perfxlm"):
        graph = LLM(out, **KW)
    notes = _notes(caplog)
    assert "exported where the engine chose otherwise for this model" in notes
    assert "weight_dtype: bfloat16 -> float32" in notes and "kv_cache_dtype: bfloat16 -> float32" in notes
    assert "quant_activations: int8_native -> float32" in notes
    _assert_same(graph, LLM(model, **KW), PROMPTS[1:])


def test_an_explicit_dtype_at_run_time_is_the_module_path_s_with_that_dtype(smollm_auto, caplog):
    model, out = smollm_auto
    with caplog.at_level(logging.WARNING, logger="perfxlm"):
        graph = LLM(out, dtype="float32", **KW)
    assert "exported with dtype='auto', run with dtype='float32'" in _notes(caplog)
    _assert_same(graph, LLM(model, dtype="float32", **KW), PROMPTS[1:])


def test_a_llama_held_in_bf16_exports_bf16_and_runs_as_the_module_path(tmp_path, monkeypatch, caplog):
    """A CPU where auto means a bf16 model (fast bf16; here the decision is patched, the layout stays this
    CPU's): bf16 matrices stored as held, a tied head (its own panel copy on the module path) still tied."""
    monkeypatch.setattr("perfxlm.config.cpu_has_fast_bf16", lambda: True)
    ckpt = make_llama_checkpoint(str(tmp_path / "ckpt"), hidden_size=80, intermediate_size=144,
                                 num_attention_heads=5, num_key_value_heads=1, num_hidden_layers=2,
                                 vocab_size=997)
    out = str(tmp_path / "graph")
    result = export_onnx(ckpt, out, flavor="perfxlm")
    recorded = _recorded(out)
    assert (recorded["weight_dtype"], recorded["compute_dtype"], recorded["quantized_source"]) == (
        "bfloat16", "float32", None)
    proto = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in proto.graph.initializer}
    assert types["model.layers.1.mlp.down_proj.weight"] == onnx.TensorProto.BFLOAT16
    assert types["model.embed_tokens.weight"] == onnx.TensorProto.BFLOAT16
    assert "lm_head.weight" not in types and result.op_census["Linear"] == 9  # 4 per layer + the tied head
    kw = dict(KW, max_num_batched_tokens=24)
    prompts = [[5], list(range(7, 16)), list(range(40, 77))]
    with caplog.at_level(logging.WARNING, logger="perfxlm"):
        graph = LLM(out, **kw)
    assert _notes(caplog) == ""
    _assert_same(graph, LLM(ckpt, **kw), prompts)


def test_a_malformed_engine_record_is_refused_by_name(smollm_auto, tmp_path):
    import shutil

    _, out = smollm_auto
    bad = str(tmp_path / "bad")
    shutil.copytree(out, bad)
    path = os.path.join(bad, "perfxlm_onnx.json")
    manifest = json.load(open(path))
    del manifest["engine"]["int8_dots"]
    json.dump(manifest, open(path, "w"))
    with pytest.raises(ValueError, match=r"perfxlm_onnx.json: its \"engine\" entry must hold exactly .*int8_dots"):
        LLM(bad, skip_tokenizer_init=True, num_kv_blocks=16)


@pytest.fixture
def tiny_gguf(tmp_path) -> str:
    from tests.quant.test_quant_engine import write_quantized_llama_gguf

    ckpt = make_llama_checkpoint(str(tmp_path / "ckpt"), hidden_size=96, intermediate_size=160,
                                 num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2)
    path = str(tmp_path / "llama.gguf")
    Q = gguf.GGMLQuantizationType
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
    write_quantized_llama_gguf(path, ckpt, {p: Q.Q8_0 if p == "token_embd" else Q.Q4_0 for p in parts})
    return path


_RUN_BOTH = """
import json, sys
from perfxlm import LLM, SamplingParams
from perfxlm.ops import cpu_plan
params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in ([5], list(range(7, 16)), list(range(40, 77)))]
kw = dict(skip_tokenizer_init=True, num_kv_blocks=40, max_num_batched_tokens=24)
run = lambda m: [list(o.outputs[0].token_ids) for o in LLM(m, **kw).generate(prompts, params, use_tqdm=False)]
print(json.dumps({"isa": cpu_plan.plan().isa, "int8_dots": cpu_plan.has_int8_dots(),
                  "graph": run(sys.argv[1]), "module": run(sys.argv[2])}))
"""


@pytest.mark.slow
def test_a_lower_tier_runs_its_own_choices_and_says_so(tmp_path, tiny_gguf, tier_build_env):
    """Exported on this CPU's tier, run under PERFXLM_ISA forcing a lower one (AVX2 on an AVX-512 or
    AVX-VNNI CPU, the scalar loops on an AVX2 one): that tier's kernels and choices, the module path's tokens
    under the same tier, and a warning naming the tier (and the int8 dot products, where that tier has none).
    Both tiers are ones the kernel tests build too (isa.DISTINCT_PATHS), so the session's one build of the
    tier serves both (tier_build_env)."""
    if native.kernels() is None:
        pytest.skip("no native kernels: no tier to force")
    lower = export_lower_tier()
    if lower is None:
        pytest.skip("this CPU runs no tier below its own")
    out = str(tmp_path / "graph")
    export_onnx(tiny_gguf, out, flavor="perfxlm")
    recorded = _recorded(out)
    assert recorded["isa"] == isa.detect() and recorded["quant_activations"] == "int8_native"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, **tier_build_env(lower))
    env.pop("PERFXLM_NATIVE_MARCH", None)
    run = subprocess.run([sys.executable, "-c", _RUN_BOTH, out, tiny_gguf], env=env, cwd=root,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["isa"] == lower
    assert result["graph"] == result["module"]
    assert "exported where the engine chose otherwise" in run.stderr
    assert f"isa: {isa.detect()} -> {lower}" in run.stderr
    if result["int8_dots"] != recorded["int8_dots"]:
        assert f"int8_dots: {recorded['int8_dots']} -> {result['int8_dots']}" in run.stderr


@pytest.mark.parametrize("family,quantization", [("mixtral-sliding", None), ("mixtral-sliding", "int4"),
                                                 ("qwen2moe-shared-dense-layer", None)])
def test_a_mixture_held_in_bf16_runs_its_experts_as_the_module_path(tmp_path, monkeypatch, caplog, family,
                                                                    quantization):
    """A bf16 model under auto (a CPU with fast bf16; the decision patched here): float expert stacks stored
    bf16, quantized ones packed, each stack's product decided as the module path's FusedMoE decides it
    (its linear methods bound by the same plan), over prefill chunks past the row limits and decodes."""
    from tests.model.test_architectures_vs_hf import build_checkpoint

    monkeypatch.setattr("perfxlm.config.cpu_has_fast_bf16", lambda: True)
    ckpt = str(tmp_path / "ckpt")
    build_checkpoint(ckpt, family)
    q = None if quantization is None else {"method": quantization, "mixed_precision": False, "calibration": False}
    out = str(tmp_path / "graph")
    export_onnx(ckpt, out, flavor="perfxlm", quantization=q)
    assert _recorded(out)["weight_dtype"] == "bfloat16"
    proto = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in proto.graph.initializer}
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    assert types.get(f"{stack}.weight", types.get(f"{stack}.codes")) == (
        onnx.TensorProto.BFLOAT16 if q is None else onnx.TensorProto.UINT8)
    prompts = [[5], list(range(7, 16)), [(i * 37) % 900 + 50 for i in range(150)]]
    with caplog.at_level(logging.WARNING, logger="perfxlm"):
        graph = LLM(out, **KW)
    assert _notes(caplog) == ""
    module = LLM(ckpt, quantization=q, **KW)
    _assert_same(graph, module, prompts)
    assert _experts(graph) == _experts(module)


def _experts(llm) -> list:
    """Each mixture's stacks: their linear methods and the choices made for them at load."""
    from perfxlm.model.layers.moe import FusedMoE

    executor = llm.llm_engine.core.executor
    root = executor.graph if executor.model is None else executor.model
    out = []
    for m in root.modules():
        if isinstance(m, FusedMoE):
            for method, w in ((m.gate_up_method, m.gate_up_proj), (m.down_method, m.down_proj)):
                out.append((method.name, getattr(w, "bf16_gemm", None), getattr(w, "activations", None), w.dtype
                            if isinstance(w, __import__("torch").Tensor) else w.bits))
    return out


def test_graph_weights_sit_as_the_module_path_s(smollm_auto):
    """Read from the folder, the weights take the loader's last step too: one huge-page block in step order
    (where the arena is on), every tensor cache-line aligned, as the fused decode layer's module path reads
    them (batch-1 decode was 0.92-0.95x the module path's with each weight on its own 4 KiB pages)."""
    from perfxlm.model.loader.weight_arena import MIN_BYTES, _enabled
    from perfxlm.quant.weight import QuantizedWeight

    _, out = smollm_auto
    graph = LLM(out, **KW).llm_engine.core.executor.graph
    tensors = [p for p in graph.parameters()]
    for m in graph.modules():
        for v in vars(m).values():
            if isinstance(v, QuantizedWeight):
                tensors += [t for t in (v.codes, v.scales, v.mins) if t is not None]
    assert len(tensors) > 100
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    if _enabled():
        large = {t.untyped_storage().data_ptr() for t in tensors if t.nbytes >= MIN_BYTES}
        assert len(large) == 1
