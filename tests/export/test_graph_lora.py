"""LoRA adapters on a `perfxlm`-flavor graph: bound at run time to the Linear nodes the export recorded
as targets, through the module path's own wrappers and kernels. Greedy float32 output token-identical to
the module path with the same adapters, in one batch of two adapters and none (prefills and fused
decode steps); int4 and GGUF Q4_0 graphs with an adapter equal the module path's quantized model with
it; an adapter for a module the graph lacks, a graph without the record, and an ONNX Runtime flavor are
refused by name; an adapter merged at export (`--lora`) equals peft's merged model."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from perfxlm import LLM, LoRARequest, SamplingParams
from perfxlm.export.lora_record import LORA_KEY
from perfxlm.export.package import export_onnx
from perfxlm.ops import native
from tests.conftest import assert_pool_whole, make_llama_checkpoint
from tests.lora.conftest import make_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
PROMPTS = [list(range(7, 16)), [5], list(range(40, 71)), list(range(100, 113))]  # 9, 1, 31, 13 tokens
# odd sizes: 5 heads of 18 over 1 KV head, 150 MLP channels, 2 layers
SHAPE = dict(hidden_size=90, intermediate_size=150, num_attention_heads=5, num_key_value_heads=1)
KW = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
          enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("base")), seed=5, num_hidden_layers=2,
                                 tie_word_embeddings=False, **SHAPE)


@pytest.fixture(scope="module")
def two_adapters(base, tmp_path_factory) -> tuple[LoRARequest, LoRARequest]:
    """a: every projection, rank 4; b: q, v and down only, rank 7, rsLoRA, its own alpha for down."""
    root = tmp_path_factory.mktemp("adapters")
    a = make_adapter(base, str(root / "a"), seed=1)
    b = make_adapter(base, str(root / "b"), seed=2, r=7, targets=("q_proj", "v_proj", "down_proj"),
                     use_rslora=True, alpha_pattern={"down_proj": 3.0})
    return LoRARequest("a", 1, a), LoRARequest("b", 2, b)


@pytest.fixture(scope="module")
def graph(base, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("graph") / "out")
    export_onnx(base, out, flavor="perfxlm", dtype="float32")
    return out


def _generate(llm, loras, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [lp[t].logprob for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    return tokens, logprobs


def test_mixed_adapters_on_the_graph_are_the_module_path(base, graph, two_adapters):
    a, b = two_adapters
    loras = [a, b, None, a]
    on_graph = LLM(graph, **KW)
    got, got_lp = _generate(on_graph, loras)
    fused = on_graph.llm_engine.core.executor.graph.fused_decode
    fused_steps = fused.steps
    want, want_lp = _generate(LLM(base, **KW), loras)
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, rtol=0)
    plain, _ = _generate(on_graph, None)
    assert got[0] != plain[0] and got[1] != plain[1] and got[2] == plain[2]  # each adapter changes its row only
    executor = on_graph.llm_engine.core.executor
    assert len(executor.lora_wrappers) == 2 * 4  # qkv, o, gate_up, down per layer
    if native.kernels() is not None:  # the all-decode steps with adapters took the fused layer's LoRA kernel
        assert fused_steps > 0 and fused.lora_fits
    assert on_graph.llm_engine.core.runner.lora_slots.num_repacks >= 1
    assert_pool_whole(on_graph)


def test_an_adapter_for_a_module_the_graph_lacks_is_refused_by_name(base, graph, two_adapters, tmp_path):
    deeper = make_llama_checkpoint(str(tmp_path / "deeper"), seed=5, num_hidden_layers=3, **SHAPE)
    stray = LoRARequest("stray", 9, make_adapter(deeper, str(tmp_path / "stray"), seed=4, targets=("o_proj",)))
    llm = LLM(graph, **KW)
    with pytest.raises(ValueError, match=r"targets 'model\.layers\.2\.self_attn\.o_proj', which is not a projection"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=stray)
    got, _ = _generate(llm, [two_adapters[0]] * 2, PROMPTS[:2])  # the engine goes on, its pool whole
    assert len(got) == 2
    assert_pool_whole(llm)


def _edited(graph: str, dst, edit) -> str:
    import shutil

    shutil.copytree(graph, dst)
    path = os.path.join(dst, "model.onnx")
    model = onnx.load(path, load_external_data=False)
    edit(model)
    onnx.save(model, path)
    return str(dst)


def test_graphs_without_the_record_or_run_by_onnx_runtime_refuse_lora(base, graph, tmp_path):
    def drop_record(model):
        keep = [p for p in model.metadata_props if p.key != LORA_KEY]
        del model.metadata_props[:]
        model.metadata_props.extend(keep)

    old = _edited(graph, tmp_path / "old", drop_record)
    with pytest.raises(ValueError, match="records no LoRA targets .* export the model again"):
        LLM(old, **KW)
    LLM(old, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)  # without LoRA it still runs

    def rename_node(model):
        next(n for n in model.graph.node if n.name == "model.layers.1.mlp.down_proj").name = "renamed"

    with pytest.raises(ValueError, match=r"name 'model\.layers\.1\.mlp\.down_proj', which is not a Linear node"):
        LLM(_edited(graph, tmp_path / "renamed", rename_node), **KW)

    def newer_record(model):
        next(p for p in model.metadata_props if p.key == LORA_KEY).value = '{"version": 2}'

    with pytest.raises(ValueError, match=r"LoRA target record \(perfxlm.lora_targets\) is not one this engine reads "
                                         r"\(version 2, this engine reads 1\)"):
        LLM(_edited(graph, tmp_path / "newer", newer_record), **KW)
    ort = str(tmp_path / "ort")
    # (heads of 18 channels: the ort flavor's GroupQueryAttention takes multiples of 8, so standard ops)
    export_onnx(base, ort, flavor="standard")
    with pytest.raises(ValueError, match="'standard'-flavor ONNX export.*LoRA adapters run on perfxlm-flavor exports"):
        LLM(ort, **KW)


@pytest.mark.parametrize("source", ["int4", "gguf-q4_0"])
def test_quantized_graph_with_an_adapter_is_the_quantized_module_path(tmp_path, source):
    q = {"method": "int4", "mixed_precision": False, "calibration": False} if source == "int4" else None
    out = str(tmp_path / "graph")
    # (4-bit groups of 32 need input widths that are multiples of 32: 96 / 160 here)
    ckpt = make_llama_checkpoint(str(tmp_path / "ckpt"), seed=6, num_hidden_layers=2, hidden_size=96,
                                 intermediate_size=160, num_attention_heads=6, num_key_value_heads=2)
    adapter = LoRARequest("q", 3, make_adapter(ckpt, str(tmp_path / "adapter"), seed=7, r=5))
    if source != "int4":  # a GGUF file's Q4_0 blocks, kept as they are
        import gguf

        from tests.quant.test_quant_engine import write_quantized_llama_gguf

        parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        path = str(tmp_path / "llama.gguf")
        write_quantized_llama_gguf(path, ckpt, {p: gguf.GGMLQuantizationType.Q4_0 for p in parts})
        ckpt = path
    export_onnx(ckpt, out, flavor="perfxlm", quantization=q, dtype="float32")
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    qkv = next(n for n in model.graph.node if n.name == "model.layers.0.self_attn.qkv_proj")
    assert next(a.i for a in qkv.attribute if a.name == "bits") == 4  # the adapter's base stays packed
    kw = dict(KW, max_loras=1)
    loras = [adapter, None, adapter]
    got, got_lp = _generate(LLM(out, **kw), loras, PROMPTS[:3])
    module = LLM(ckpt, quantization=q, quant_activations="float32", **kw)
    want, want_lp = _generate(module, loras, PROMPTS[:3])
    want_plain, _ = _generate(module, None, PROMPTS[:1])
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4, rtol=0)
    assert got[0] != want_plain[0]  # the adapter changes the text


def _peft_merged(base: str, adapter: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def test_an_adapter_merged_at_export_is_peft_s_merged_model(base, two_adapters, tmp_path):
    """--lora: the perfxlm flavor's weights are peft's merge_and_unload() weights bit for bit (q, k, v rows
    of the fused projection included), and the standard flavor's greedy text in ONNX Runtime is the merged
    model's."""
    import torch

    from perfxlm.entrypoints.cli import main
    from perfxlm.model.graph.weights import load_graph, read_initializers
    from tests.export.onnx_helpers import ort_greedy

    b = two_adapters[1]  # q, v and down; rsLoRA; its own alpha for down
    merged = _peft_merged(base, b.lora_path)
    own = str(tmp_path / "own")
    export_onnx(base, own, flavor="perfxlm", dtype="float32", lora=b.lora_path)
    weights = read_initializers(load_graph(os.path.join(own, "model.onnx")), own)
    state = merged.state_dict()
    attn = "model.layers.1.self_attn"
    qkv = torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(weights[f"{attn}.qkv_proj.weight"], qkv)
    assert torch.equal(weights["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"])
    from safetensors.torch import load_file

    plain = load_file(os.path.join(base, "model.safetensors"))
    assert not torch.equal(qkv, torch.cat([plain[f"{attn}.{p}_proj.weight"] for p in "qkv"]))  # the adapter moved it

    # (ONNX Runtime's GroupQueryAttention takes head sizes in multiples of 8; these heads are 18: standard ops)
    ort = str(tmp_path / "standard")
    assert main(["export", "onnx", base, ort, "--flavor", "standard", "--lora", b.lora_path]) in (0, None)
    prompt = PROMPTS[2]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = merged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ort_greedy(ort, prompt, 8)[0] == want


def test_merging_into_quantized_weights_is_refused_by_name(base, two_adapters, tmp_path):
    out = tmp_path / "int8"
    with pytest.raises(ValueError, match=r"--lora: model\.layers\.0\.mlp\.down_proj is .*cannot take the "
                                         r"adapter's delta"):
        export_onnx(base, str(out), flavor="ort", quantization="int8", lora=two_adapters[0].lora_path)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".perfxlm-export")]


def test_the_server_serves_adapters_on_a_graph(base, graph, two_adapters, tmp_path, monkeypatch):
    """`perfxlm serve OUT_DIR --enable-lora --lora-modules a=PATH`, in process: the adapter by model name equals
    the module path's output with it; an adapter for a module the graph lacks is a 400 naming it, and the
    requests beside it go on."""
    import asyncio

    import httpx

    from perfxlm import AsyncLLM, EngineConfig
    from perfxlm.entrypoints.openai.api_server import build_app

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    a = two_adapters[0]
    deeper = make_llama_checkpoint(str(tmp_path / "deeper"), seed=5, num_hidden_layers=3, **SHAPE)
    stray = make_adapter(deeper, str(tmp_path / "stray"), seed=4, targets=("o_proj",))
    kw = {k: v for k, v in KW.items() if k != "skip_tokenizer_init"}
    engine = AsyncLLM(EngineConfig(model=graph, skip_tokenizer_init=True, **kw))
    app = build_app(engine, "graph", lora_modules=[("a", a.lora_path, None)])

    async def complete(client, model):
        r = await client.post("/v1/completions", json={"model": model, "prompt": PROMPTS[0], "max_tokens": 8,
                                                       "temperature": 0, "logprobs": 0, "ignore_eos": True})
        return [int(t) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await asyncio.gather(
                complete(client, "a"), complete(client, "graph"),
                client.post("/v1/load_lora_adapter", json={"lora_name": "stray", "lora_path": stray}))

    try:
        with_a, plain, load = asyncio.run(go())
        assert engine.engine.core.check_invariants()["used"] == 0
    finally:
        engine.shutdown()
    module = LLM(base, **dict(KW, max_num_batched_tokens=256))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [list(module.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False, lora_request=r)[0]
                 .outputs[0].token_ids) for r in (a, None)]
    assert [with_a, plain] == want and with_a != plain
    err = load.json()["error"]
    assert load.status_code == 400 and err["type"] == "invalid_request_error"
    assert "model.layers.2.self_attn.o_proj" in err["message"]


@pytest.mark.parametrize("family", ["phi3-longrope-partial-sliding", "qwen2moe-shared-dense-layer"])
def test_other_families_adapters_land_as_on_the_module_path(tmp_path, family):
    """Phi-3's checkpoint names are the fused projections (qkv_proj, gate_up_proj: whole targets); Qwen2-MoE's
    shared expert's projections are targets beside the routed experts, its layers run node by node."""
    from tests.model.test_architectures_vs_hf import build_checkpoint

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "graph")
    build_checkpoint(ckpt, family)
    targets = (("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if family.startswith("phi3")
               else ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))
    adapter = LoRARequest("x", 4, make_adapter(ckpt, str(tmp_path / "adapter"), seed=8, r=3, targets=targets))
    export_onnx(ckpt, out, flavor="perfxlm", dtype="float32")
    loras = [adapter, None]
    got, got_lp = _generate(LLM(out, **KW), loras, PROMPTS[:2])
    want, want_lp = _generate(LLM(ckpt, **KW), loras, PROMPTS[:2])
    assert got == want and got[0] != _generate(LLM(ckpt, **KW), None, PROMPTS[:1])[0][0]
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-5, rtol=0)
