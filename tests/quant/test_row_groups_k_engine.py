"""K-quant row groups (CodeLayout.ROWS8_K) in the engine, on a Q4_K_M file (llama-quantize's choice,
through llama.cpp's bindings: Q4_K matrices, Q6_K for layer 0's V and down and the tied table, whose
lookups unpack the groups they read). The CPU plan (PERFXLM_ROW_INTERLEAVE=8, PERFXLM_ROW_GROUPS_K) gives
them to the LM head only ("head") or to every K-quant matrix ("all": layer 1's fused QKV, both layers' gate|up,
o and down; one layer's QKV fuses Q4_K beside Q6_K: a split weight, q|k and v each in row groups, or with
PERFXLM_SPLIT_JOINS=0 one weight widened to 8-bit codes, plain). Greedy text is the plain
layout's (float32 compute, int8 activation blocks), a request alone what it is in a batch, and logprobs
the plain layout's to float rounding (prompt rows through the int8 GEMM: the plain layout's bits there)."""

from __future__ import annotations

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.ops import cpu_plan, native
from perfxlm.quant import act_blocks, row_groups_k
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.loading import unique_quantized_weights
from perfxlm.quant.split_rows import SPLIT_ENV, SplitRows
from tests.conftest import make_llama_checkpoint

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no compiler for the native kernels")

# K-quants need inputs in whole 256s: hidden 256, intermediate 512; a vocabulary not a multiple of 8
CHECKPOINT = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                  num_hidden_layers=2, vocab_size=1001)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17] * 9, [7, 300, 8, 301, 9] * 3, list(range(40, 97))]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> str:
    pytest.importorskip("llama_cpp")
    from benchmarks.compare_llamacpp import requantize
    from tests.quant.test_quant_engine import write_quantized_llama_gguf

    root = tmp_path_factory.mktemp("rgk_gguf")
    base = make_llama_checkpoint(str(root / "base"), seed=7, **CHECKPOINT)
    f32 = str(root / "f32.gguf")
    write_quantized_llama_gguf(f32, base, {})
    return requantize(f32, "q4_k_m", 2, root / "q4_k_m.gguf")


def _run(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])]) for o, p in zip(outs, prompts)]


def test_a_q6_k_head_in_row_groups_gives_the_plain_layouts_text(q4_k_m, interleave, monkeypatch):
    runs = {}
    for value in (0, 8):
        monkeypatch.setenv("PERFXLM_ROW_GROUPS_K", "head" if value else "off")
        interleave(value)
        llm = LLM(q4_k_m, skip_tokenizer_init=True, dtype="float32", kv_cache_gib=0.05, quant_activations="int8")
        model = llm.llm_engine.core.model
        head = model.lm_head.weight
        assert head.layout is (CodeLayout.ROWS8_K if value else CodeLayout.PLAIN) and head.bits == 6
        # "head": the projections' K-quants stay plain
        assert CodeLayout.ROWS8_K not in {w.layout for w in unique_quantized_weights(model) if w is not head}
        batch = _run(llm, PROMPTS)
        alone = [_run(llm, [p])[0] for p in PROMPTS]
        for (ta, la, pa), (tb, lb, pb) in zip(alone, batch):  # a request alone is what it is in the batch
            assert ta == tb
            assert la == pytest.approx(lb, abs=1e-4) and pa == pytest.approx(pb, abs=1e-4)
        runs[value] = batch
    # the same text; logprobs and prompt logprobs (every prompt row through the head's GEMV) to float
    # rounding: the two heads sum a row's blocks in other orders
    for (ta, la, pa), (tb, lb, pb) in zip(runs[0], runs[8]):
        assert ta == tb
        assert la == pytest.approx(lb, abs=1e-3) and pa == pytest.approx(pb, abs=1e-3)


def test_every_k_matrix_in_row_groups_gives_the_plain_layouts_text(q4_k_m, interleave, monkeypatch):
    interleave(8)
    runs = {}
    for value in ("off", "all"):
        monkeypatch.setenv("PERFXLM_ROW_GROUPS_K", value)
        cpu_plan.reset()
        llm = LLM(q4_k_m, skip_tokenizer_init=True, dtype="float32", kv_cache_gib=0.05, quant_activations="int8")
        model = llm.llm_engine.core.model
        k_quants = [w for w in unique_quantized_weights(model) if w.layout is CodeLayout.PLAIN and row_groups_k.takes(w)]
        layouts = {w.layout for w in unique_quantized_weights(model)}
        if value == "off":
            assert CodeLayout.ROWS8_K not in layouts and len(k_quants) >= 6
        else:  # every K-quant matrix (the tied head's table too); the mixed fused QKV's parts as well
            assert not k_quants and model.lm_head.weight.layout is CodeLayout.ROWS8_K
            assert sum(w.layout is CodeLayout.ROWS8_K for w in unique_quantized_weights(model)) >= 6
            split = [layer.self_attn.qkv_proj.weight for layer in model.model.layers
                     if isinstance(layer.self_attn.qkv_proj.weight, SplitRows)]
            assert len(split) == 1 and [p.bits for p in split[0].parts] == [4, 6]
            assert CodeLayout.PLAIN not in layouts
        batch = _run(llm, PROMPTS)
        alone = [_run(llm, [p])[0] for p in PROMPTS]
        for (ta, la, pa), (tb, lb, pb) in zip(alone, batch):  # a request alone is what it is in the batch
            assert ta == tb
            assert la == pytest.approx(lb, abs=1e-4) and pa == pytest.approx(pb, abs=1e-4)
        runs[value] = batch
    # the same text; logprobs to float rounding amplified: each projection's output is the next one's int8
    # activation blocks, where a float-order difference can move a value across a rounding step (1/127 of
    # its block's largest), layer after layer (the head alone, above, stays within 1e-3)
    for (ta, la, pa), (tb, lb, pb) in zip(runs["off"], runs["all"]):
        assert ta == tb
        assert la == pytest.approx(lb, abs=5e-2) and pa == pytest.approx(pb, abs=5e-2)


def test_a_split_qkv_gives_the_widened_ones_text(q4_k_m, interleave, monkeypatch):
    """The Q4_K | Q6_K QKV as a split weight (parts in row groups) or widened to one 8-bit weight: the
    same greedy text, logprobs to float rounding; the fused decode layer ran. Activations round in blocks
    of 32 for both (`fine`): under ggml's rule the split parts, K-quants, take q8_K's blocks of 256 while
    the widened 8-bit weight is no K-quant, and that rounding, not the join, would part their logprobs."""
    interleave(8)
    monkeypatch.setenv("PERFXLM_ROW_GROUPS_K", "all")
    runs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(SPLIT_ENV, value)
        cpu_plan.reset()
        llm = LLM(q4_k_m, skip_tokenizer_init=True, dtype="float32", kv_cache_gib=0.05, quant_activations="int8")
        qkvs = [layer.self_attn.qkv_proj.weight for layer in llm.llm_engine.core.model.model.layers]
        assert sum(isinstance(w, SplitRows) for w in qkvs) == (value == "1")
        with act_blocks.using("fine"):
            runs[value] = _run(llm, PROMPTS)
    for (ta, la, pa), (tb, lb, pb) in zip(runs["0"], runs["1"]):
        assert ta == tb
        assert la == pytest.approx(lb, abs=5e-2) and pa == pytest.approx(pb, abs=5e-2)
