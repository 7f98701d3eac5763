"""bf16 exports of the families beyond the Llama block (`--dtype bfloat16`, the perfxlm flavor): Gemma 2 / 3,
GLM-4, OPT, gpt-oss, DeepSeek-V2 / V3 on random checkpoints of odd sizes. Their float matrices (expert
stacks included) are stored bf16, as the engine holds them, and the engine running the folder in bf16 is
its module path in bf16: the same kernels on the same values, so greedy tokens are identical and
logprobs equal to float rounding (Gemma's (1 + w) norms run the native RMSNorm on the graph, the module
path's torch formula: 1e-5 apart on Gemma 3), over a chunked prompt, decodes of three lengths and
prefix-cache hits."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx
from perfxlm.ops import native
from tests.conftest import assert_pool_whole
from tests.export.test_perfxlm_graph import _checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [[5], list(range(7, 16)), list(range(40, 71))]  # 1, 9, 31 tokens: chunked at 24, past the windows
KW = dict(skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=48, max_num_batched_tokens=24,
          enable_prefix_caching=True)
# family -> a float matrix the export must store bf16 (an expert stack where the family has one)
FAMILIES = {
    "gemma2-softcap-local-global": "model.layers.1.mlp.down_proj.weight",
    "gemma3-softcaps-untied": "lm_head.weight",
    "glm4-post-norms": "model.layers.0.self_attn.qkv_proj.weight",
    "opt-pre-ln": "model.decoder.layers.1.fc2.weight",
    "gptoss-sinks-alternating": "model.layers.0.mlp.experts.gate_up_proj.weight",
    "deepseekv2-lite-yarn": "model.layers.1.mlp.experts.down_proj.weight",
    "deepseekv3-noaux-grouped": "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [lp[t].logprob for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_export_runs_as_the_module_path_in_bf16(tmp_path, family):
    if native.kernels() is None:  # (without them a bf16 engine computes in bf16, which a graph does not run)
        pytest.skip("no native kernels: bf16 weights widen in the native kernels only")
    ckpt, out = _checkpoint(str(tmp_path / "ckpt"), family), str(tmp_path / "graph")
    export_onnx(ckpt, out, flavor="perfxlm", dtype="bfloat16")
    proto = onnx.load(os.path.join(out, "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in proto.graph.initializer}
    assert types[FAMILIES[family]] == onnx.TensorProto.BFLOAT16
    assert all(t == onnx.TensorProto.FLOAT for n, t in types.items() if n.endswith("norm.weight"))
    graph = LLM(out, **KW)
    assert graph.llm_engine.config.weight_dtype == torch.bfloat16
    want, want_lp = _generate(LLM(ckpt, **KW))
    got, got_lp = _generate(graph)
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4, rtol=0)
    assert len({t for seq in got for t in seq}) > 5  # random enough that the steps differ
    assert _generate(graph)[0] == want  # the prompts' full blocks from the prefix cache
    assert_pool_whole(graph)
