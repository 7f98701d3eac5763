"""The engine running an exported graph (load_format "onnx", detected from the folder): greedy output
token-identical to the module path over mixed-length prompts in one batch, chunked prefill, the prefix
cache, prompt logprobs and n > 1, with the KV pool whole afterwards; refusals of a folder whose version
or ops the engine does not know, and of options an export fixes."""

from __future__ import annotations

import json
import os

import onnx
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx
from tests.conftest import assert_pool_whole
from tests.model.test_architectures_vs_hf import build_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
PROMPTS = [[5], list(range(7, 16)), list(range(40, 77))]  # 1, 9, 37 tokens: past the sliding windows


pytestmark = pytest.mark.usefixtures("one_thread")


def _generate(llm, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], outs


@pytest.mark.parametrize("case,flavor", [("qwen3-qknorm-headdim-bias", "ort"),
                                         ("phi3-longrope-partial-sliding", "standard")])
def test_engine_runs_the_exported_graph_as_the_module_path(tmp_path, case, flavor):
    """Decodes of sequences of different lengths run as one padded batch, sliding windows included."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "onnx")
    build_checkpoint(ckpt, case)
    export_onnx(ckpt, out, flavor=flavor)
    graph = LLM(out, skip_tokenizer_init=True, num_kv_blocks=64, max_num_batched_tokens=24)  # chunks the 37
    assert graph.llm_engine.config.load_format == "onnx"
    module = LLM(ckpt, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    want, want_outs = _generate(module)
    runner_graph = graph.llm_engine.core.runner.graph
    batches, run_decodes = [], runner_graph.run_decodes

    def recording(ids, pasts):
        batches.append([p[0].shape[2] for p in pasts])
        return run_decodes(ids, pasts)

    runner_graph.run_decodes = recording
    got, got_outs = _generate(graph)
    assert got == want
    assert any(len(set(lens)) == len(lens) == 3 for lens in batches)  # one call, three past lengths
    for g, w in zip(got_outs, want_outs):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert _generate(graph)[0] == want  # now the prompts' full blocks come from the prefix cache
    scored = SamplingParams(max_tokens=1, prompt_logprobs=2)
    for g, w in zip(_generate(graph, PROMPTS[1:], scored)[1], _generate(module, PROMPTS[1:], scored)[1]):
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    siblings = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6)
    assert _generate(graph, PROMPTS[1:], siblings)[0] == _generate(module, PROMPTS[1:], siblings)[0]
    assert_pool_whole(graph)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("exported")
    build_checkpoint(str(root / "ckpt"), "mistral-sliding-mqa")
    export_onnx(str(root / "ckpt"), str(root / "onnx"), flavor="ort")
    return str(root / "onnx")


def _copy(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_unknown_format_version_is_refused_by_name(exported, tmp_path):
    folder = _copy(exported, tmp_path / "v99")
    path = os.path.join(folder, "perfxlm_onnx.json")
    manifest = json.load(open(path))
    json.dump({**manifest, "format_version": 99}, open(path, "w"))
    with pytest.raises(ValueError, match="format_version 99 is not known"):
        LLM(folder, skip_tokenizer_init=True, num_kv_blocks=16)


def test_a_graph_with_an_unknown_op_is_refused_by_name(exported, tmp_path):
    folder = _copy(exported, tmp_path / "custom")
    path = os.path.join(folder, "model.onnx")
    model = onnx.load(path, load_external_data=False)
    logits = next(n for n in model.graph.node if "logits" in n.output)
    logits.op_type, logits.domain = "PagedAttention", "perfxlm"
    onnx.save(model, path)
    with pytest.raises(ValueError, match="op perfxlm::PagedAttention, which the engine does not run"):
        LLM(folder, skip_tokenizer_init=True, num_kv_blocks=16)


def test_options_an_export_fixes_are_refused(exported, tmp_path):
    with pytest.raises(ValueError, match="quantization='int4' does not apply to an exported ONNX graph"):
        LLM(exported, skip_tokenizer_init=True, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' does not apply"):
        LLM(exported, skip_tokenizer_init=True, kv_cache_dtype="int8")
    (tmp_path / "config.json").write_text(open(os.path.join(exported, "config.json")).read())
    with pytest.raises(ValueError, match="has no perfxlm_onnx.json"):
        LLM(str(tmp_path), skip_tokenizer_init=True, load_format="onnx")


def test_a_bad_request_fails_alone(exported):
    llm = LLM(exported, skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="out of vocabulary|vocab"):
        llm.generate([{"prompt_token_ids": [5, 10**6]}], GREEDY, use_tqdm=False)
    assert len(_generate(llm, PROMPTS[:2])[0]) == 2
    assert_pool_whole(llm)
