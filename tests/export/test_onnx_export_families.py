"""`perfxlm export onnx` for the families beyond the Llama block, on random-weight checkpoints of odd sizes:
Qwen3-MoE, GLM / GLM-4, Gemma 2 / 3, OPT, gpt-oss, DeepSeek-V2 / V3 (and the older mixtures, Mixtral and
Qwen2-MoE, which the ort and standard flavors now write too). Each graph run in ONNX Runtime over a prompt
and 16 greedy decode steps with the growing past fed back: float32 logits of every call within 1e-4 of
transformers'; the engine's ONNX runner on such a folder token-identical to the module path; a flavor
that cannot express a family refused by name, with the reason, leaving nothing behind (the perfxlm
flavor's own families: test_perfxlm_graph.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx
from tests.conftest import assert_pool_whole
from tests.export.onnx_helpers import ort_greedy
from tests.model import test_architectures_vs_hf as older
from tests.model import test_recent_families_vs_hf as recent

STEPS = 16
PROMPT = [int(t) for t in np.random.RandomState(7).randint(3, 1000, size=23)]  # past every sliding window

pytestmark = pytest.mark.usefixtures("one_thread")

# every family in the standard flavor, at the engine tests' odd sizes
STANDARD = ["qwen3moe-normtopk-sparse-step", "glm-partial-interleaved", "glm4-post-norms",
            "gemma2-softcap-local-global", "gemma3-5to1-two-bases", "opt-post-ln-projected",
            "gptoss-sinks-alternating", "deepseekv2-grouped-qlora", "deepseekv3-noaux-grouped"]
# the ort flavor: ONNX Runtime's GroupQueryAttention takes head sizes in multiples of 8 only (every released
# model's), so some cases are built with such heads; DeepSeek's heads are its latent rows (kv_lora + rope)
ORT = [("qwen3moe-unnormalised-sliding", {}), ("gemma3-softcaps-untied", {}), ("opt-pre-ln", {}),
       ("mixtral-sliding", {}), ("qwen2moe-shared-dense-layer", {}), ("gptoss-sinks-alternating", {"head_dim": 16}),
       ("deepseekv2-lite-yarn", {"kv_lora_rank": 40}), ("deepseekv3-rotate-half", {"kv_lora_rank": 20})]


def checkpoint(path: str, case: str, **changes):
    """A random-weight transformers model of `case` saved at `path` (the engine tests' builders)."""
    if case in recent.CASES:
        return recent.build_checkpoint(path, case, **changes)
    assert not changes
    return older.build_checkpoint(path, case)


def _assert_matches_transformers(tmp_path, case: str, flavor: str, **changes) -> dict:
    hf = checkpoint(str(tmp_path / "ckpt"), case, **changes)
    out = str(tmp_path / "onnx")
    export_onnx(str(tmp_path / "ckpt"), out, flavor=flavor)

    def reference(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].numpy()

    tokens, _, diffs = ort_greedy(out, PROMPT, STEPS, reference)
    assert len(diffs) == STEPS + 1 and max(diffs) < 1e-4, diffs
    assert len(set(tokens)) >= 3  # random enough that the decode steps differ
    return json.load(open(os.path.join(out, "genai_config.json")))["model"]


@pytest.mark.parametrize("case", STANDARD)
def test_standard_flavor_matches_transformers(tmp_path, case):
    genai = _assert_matches_transformers(tmp_path, case, "standard")
    model = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    assert {n.domain for n in model.graph.node} == {""}
    if case.startswith("deepseek"):  # the latent cache: one head of kv_lora_rank + rope channels
        config = json.load(open(tmp_path / "ckpt" / "config.json"))
        assert genai["decoder"]["num_key_value_heads"] == 1
        assert genai["decoder"]["head_size"] == config["kv_lora_rank"] + config["qk_rope_head_dim"]


@pytest.mark.parametrize("case,changes", ORT, ids=[c for c, _ in ORT])
def test_ort_flavor_matches_transformers(tmp_path, case, changes):
    _assert_matches_transformers(tmp_path, case, "ort", **changes)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False).graph.node}
    assert "GroupQueryAttention" in ops
    if case.startswith("gptoss"):  # the sinks as GroupQueryAttention's head_sink
        model = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
        gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
        assert len(gqa.input) == 12 and gqa.input[11].endswith("sinks")


# (case, config changes, flavor, lacking): what each flavor cannot write is named, with the flavors that can
# (every flavor writes every family today: `lacking` takes a feature from the perfxlm flavor's list, as a
# family named later would find it)
REFUSED = [
    ("deepseekv3-noaux-grouped", {}, "perfxlm", "latent_attention", "multi-head latent attention"),
    ("glm-partial-interleaved", {}, "ort", None, "GroupQueryAttention takes multiples of 8 only"),
]


@pytest.mark.parametrize("case,changes,flavor,lacking,why", REFUSED, ids=[f"{c}-{f}" for c, _, f, _, _ in REFUSED])
def test_a_flavor_that_cannot_express_a_family_is_refused_by_name(tmp_path, monkeypatch, case, changes, flavor,
                                                                  lacking, why):
    from perfxlm.export.perfxlm_ops import PerfxlmOps

    if lacking is not None:
        monkeypatch.setattr(PerfxlmOps, "features", PerfxlmOps.features - {lacking})
    checkpoint(str(tmp_path / "ckpt"), case, **changes)
    out = tmp_path / "onnx"
    with pytest.raises(ValueError, match="ONNX export") as err:
        export_onnx(str(tmp_path / "ckpt"), str(out), flavor=flavor)
    assert why in str(err.value)
    if flavor == "perfxlm":
        assert "which the perfxlm flavor cannot express" in str(err.value)
        assert "flavors that can: ort, standard" in str(err.value)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".perfxlm-export")]


RUNNER = [("gptoss-sinks-alternating", {"head_dim": 16}, "ort"), ("deepseekv2-grouped-qlora", {}, "standard"),
          ("gemma3-5to1-two-bases", {}, "standard"), ("opt-pre-ln", {}, "ort")]


@pytest.mark.parametrize("case,changes,flavor", RUNNER, ids=[f"{c}-{f}" for c, _, f in RUNNER])
def test_engine_runs_the_exported_graph_as_the_module_path(tmp_path, case, changes, flavor):
    """The engine's ONNX runner (decodes of three lengths in one padded call, a chunked prompt, the prefix
    cache) on sinks, routed experts, the latent cache, per-layer rotary tables and learned positions."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "onnx")
    checkpoint(ckpt, case, **changes)
    export_onnx(ckpt, out, flavor=flavor)
    prompts = [[5], list(range(7, 16)), list(range(40, 77))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [
            lp[t].logprob for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]

    graph = LLM(out, skip_tokenizer_init=True, num_kv_blocks=64, max_num_batched_tokens=24)
    assert graph.llm_engine.config.load_format == "onnx"
    want, want_lp = run(LLM(ckpt, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64))
    got, got_lp = run(graph)
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4, rtol=0)
    assert run(graph)[0] == want  # the prompts' full blocks from the prefix cache
    assert_pool_whole(graph)


def test_int4_mixture_keeps_each_expert_packed_and_matches_the_engine(tmp_path):
    """Expert stacks quantized at load are written expert by expert as MatMulNBits (codes kept), greedy
    output and logprobs equal to the engine's own quantized path."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "onnx")
    # input sizes the int4 groups (32) divide
    checkpoint(ckpt, "qwen3moe-unnormalised-sliding", hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
    quantization = {"method": "int4", "mixed_precision": False, "calibration": False}
    export_onnx(ckpt, out, flavor="ort", quantization=quantization)
    model = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    packed = [n.name for n in model.graph.node if n.op_type == "MatMulNBits" and ".experts." in n.name]
    assert len(packed) == 2 * 5 * 2  # two sparse layers, five experts, gate|up and down
    tokens, logprobs, _ = ort_greedy(out, PROMPT, STEPS)
    llm = LLM(ckpt, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, quantization=quantization,
              quant_activations="float32")
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    want = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert tokens == list(want.token_ids)
    np.testing.assert_allclose(logprobs, [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)],
                               atol=1e-4, rtol=0)
